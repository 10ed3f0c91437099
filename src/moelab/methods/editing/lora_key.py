"""The decoupled-routing baseline: a LoRA expert per edit plus a stored key, routed by cosine
similarity (LEMoE / LiveEdit-style: "modular isolation plus decoupled routing", the design
TIME's abstract argues against).

Edit e adds ``B_e A_e a`` (rank r, ``A [r, d_in]``, ``B [d_out, r]``, B = 0 at the start as
in LoRA) on tokens whose activation ``a`` has cosine ≥ ``threshold`` with its key ``k_e``,
the mean activation at the edit's positions [I]. Parameters per edit:
``r·(d_in + d_out) + d_in`` (the key counts: it is what this design needs beyond the expert).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.methods.editing.layer import EditBank


class LoRAKeyBank(EditBank):
    """Frozen edits as buffers ``lora_a [E, r, d_in]``, ``lora_b [E, d_out, r]``,
    ``keys [E, d_in]``; one cosine threshold for all."""

    def __init__(self, d_in: int, d_out: int, rank: int, threshold: float) -> None:
        super().__init__()
        self.rank, self.threshold = rank, threshold
        self.params_per_edit = rank * (d_in + d_out) + d_in
        self.register_buffer("lora_a", torch.zeros(0, rank, d_in))
        self.register_buffer("lora_b", torch.zeros(0, d_out, rank))
        self.register_buffer("keys", torch.zeros(0, d_in))
        self.pending: nn.ParameterDict | None = None
        self._pending_key: Tensor | None = None

    @property
    def num_edits(self) -> int:
        return self.keys.shape[0]

    def scores(self, a: Tensor) -> Tensor:
        return F.normalize(a.float(), dim=-1) @ F.normalize(self.keys.float(), dim=-1).T

    def thresholds(self) -> Tensor:
        return torch.full((self.num_edits,), self.threshold, device=self.keys.device)

    def outputs(self, a: Tensor, base: Tensor, idx: Tensor) -> Tensor:
        low = torch.einsum("nri,ni->nr", self.lora_a[idx].float(), a.float())
        return base + torch.einsum("nor,nr->no", self.lora_b[idx].float(), low)

    def start(self, a: Tensor, layer: nn.Linear) -> list[nn.Parameter]:
        d_out, d_in = layer.weight.shape
        lora_a = torch.empty(self.rank, d_in)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))  # PEFT's LoRA A init
        self.pending = nn.ParameterDict(
            {"lora_a": nn.Parameter(lora_a), "lora_b": nn.Parameter(torch.zeros(d_out, self.rank))}
        )
        self._pending_key = a.float().mean(0)
        return list(self.pending.values())

    def pending_outputs(self, a: Tensor, base: Tensor) -> Tensor:
        return base + a.float() @ self.pending["lora_a"].T @ self.pending["lora_b"].T

    def commit(self) -> None:
        self._append(keys=self._pending_key, **{k: p for k, p in self.pending.items()})
        self.pending, self._pending_key = None, None
