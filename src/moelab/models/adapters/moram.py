"""Self-routed rank-1 associative-memory atoms on one dense layer (MoRAM, ICML 2026;
``XTAIL/loralib/moram.py::MoRAM_Linear`` of Artificer-AI-Lab/MoRAM, the authors' code [C]).

Atom ``i`` is a key ``a_i`` (a row of A ``[N, in]``) and a value ``b_i`` (a column of B
``[out, N]``); there is no router, each atom scores its own relevance:

1. ``z = x·Aᵀ`` ``[T, N]`` (old atoms first, then the trainable ones);
2. ``ẑ = z / ‖z‖₂`` across atoms;
3. keep the ``k = min(max(topk, 2), N)`` largest ``ẑ`` (the authors' ``max(topk, 2)``; capped
   at N here, where ``torch.topk`` would fail [I]);
4. ``w = softmax(ẑ_topk / τ)`` (0 outside the top-k);
5. evaluation only: ``w ← w·𝟙[ẑ ≥ δ]``, not renormalised (an input no atom recognises gets
   Δy = 0: the pretrained layer's output);
6. ``y = base(x) + (z ⊙ w)·Bᵀ``, scale 1 (``lora_scaling = 1`` [C]).

:meth:`MoRAMLinear.grow` is ``increment_task`` [C]: the current atoms join the frozen
``old_lora_A``/``old_lora_B`` (separate parameters, so neither gradients nor an optimizer's
weight decay can move them) and r fresh trainable atoms follow (A Kaiming-uniform with a = √5,
B zeros: a fresh set adds exact zeros).

Telemetry: every forward leaves a :class:`~moelab.core.telemetry.RoutingRecord` whose pairs
are the atoms that contribute to each token (the top-k; in evaluation only those passing δ)
whose ``logits`` are ẑ and whose ``probs`` are the weights ``w`` (after the gate in eval mode).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.lora import lora_uniform_


class MoRAMLinear(nn.Module):
    """A frozen ``nn.Linear`` plus self-routed rank-1 atoms (module docstring).

    Args:
        base: the layer to adapt; its parameters get ``requires_grad=False``.
        rank: r >= 1, atoms added per :meth:`grow` (and at construction).
        topk: atoms kept per token before the softmax (None: r, the authors' default).
        temperature: τ > 0 of the softmax (0.01 [C]).
        threshold: δ of the evaluation gate (0.2 [C]); 0 disables the gate.

    Weights:
        lora_A ``[r, in]``, lora_B ``[out, r]``: the trainable atoms.
        old_lora_A ``[N_old, in]``, old_lora_B ``[out, N_old]``: the frozen atoms (None before
            the first :meth:`grow`).
    Attributes:
        last_record: the :class:`~moelab.core.telemetry.RoutingRecord` of the last forward
            (tokens = the flattened leading dims of x, every token counted as real).
    Forward:
        x ``[..., in]`` → ``[..., out]`` in x's dtype.
    Raises:
        InvalidTypeError: ``base`` is not an ``nn.Linear``.
        InvalidValueError: r < 1, topk < 1, τ <= 0 or δ outside ``[0, 1]``.
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        topk: int | None = None,
        temperature: float = 0.01,
        threshold: float = 0.2,
    ) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise InvalidTypeError(f"base: expected nn.Linear, got {type(base).__name__}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidValueError(f"rank: must be an int >= 1, got {rank!r}")
        topk = rank if topk is None else topk
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise InvalidValueError(f"topk: must be None or an int >= 1, got {topk!r}")
        if not temperature > 0:
            raise InvalidValueError(f"temperature: must be > 0, got {temperature!r}")
        if not 0 <= threshold <= 1:
            raise InvalidValueError(f"threshold: must be in [0, 1], got {threshold!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.topk = rank, topk
        self.temperature, self.threshold = float(temperature), float(threshold)
        self.register_parameter("old_lora_A", None)
        self.register_parameter("old_lora_B", None)
        self.lora_A, self.lora_B = self._new_atoms()
        self.last_record: RoutingRecord | None = None

    def _new_atoms(self) -> tuple[nn.Parameter, nn.Parameter]:
        w = self.base.weight
        kw = {"dtype": w.dtype, "device": w.device}
        a = lora_uniform_(torch.empty(self.rank, self.base.in_features, **kw))
        return nn.Parameter(a), nn.Parameter(torch.zeros(self.base.out_features, self.rank, **kw))

    @property
    def num_atoms(self) -> int:
        """N, old and new atoms."""
        return self.num_frozen + self.rank

    @property
    def num_frozen(self) -> int:
        """The old (frozen) atoms, indices ``[0, num_frozen)``."""
        return 0 if self.old_lora_A is None else self.old_lora_A.shape[0]

    def atoms(self) -> tuple[Tensor, Tensor]:
        """``(A [N, in], B [out, N])``: old atoms then new ones."""
        if self.old_lora_A is None:
            return self.lora_A, self.lora_B
        return (
            torch.cat([self.old_lora_A, self.lora_A]),
            torch.cat([self.old_lora_B, self.lora_B], dim=1),
        )

    def frozen_parameters(self) -> Iterator[nn.Parameter]:
        """The old atoms (they keep ``requires_grad=False``)."""
        for p in (self.old_lora_A, self.old_lora_B):
            if p is not None:
                yield p

    def weights(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(w [T, N], selected [T, N] bool, ẑ [T, N])`` from the projections ``z [T, N]``:
        steps 2–5 of the module docstring (the gate only in eval mode); ``selected`` marks
        the atoms that contribute (top-k, and passing δ in eval mode)."""
        zn = F.normalize(z, p=2, dim=-1)
        k = min(max(self.topk, 2), z.shape[-1])
        top, idx = zn.topk(k, dim=-1)
        masked = torch.full_like(zn, float("-inf")).scatter(-1, idx, top)
        w = torch.softmax(masked / self.temperature, dim=-1)
        selected = torch.zeros_like(zn, dtype=torch.bool).scatter(-1, idx, True)
        if not self.training and self.threshold > 0:
            passed = zn >= self.threshold
            w = w * passed.to(w.dtype)
            selected = selected & passed
        return w, selected, zn

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        A, B = self.atoms()
        x_TI = x.reshape(-1, x.shape[-1])
        z = x_TI @ A.T
        w, selected, zn = self.weights(z)
        self._record(w, selected, zn, tuple(x.shape[:-1]))
        return y + ((z * w) @ B.T).reshape(y.shape)

    def _record(
        self, w: Tensor, selected: Tensor, zn: Tensor, batch_shape: tuple[int, ...]
    ) -> None:
        sel = selected.detach()
        tokens, atoms = sel.nonzero(as_tuple=True)
        probs = w.detach().float()
        plan = RoutingPlan(
            token_idx=tokens,
            expert_idx=atoms,
            weight=probs[tokens, atoms],
            logits=zn.detach().float(),
            probs=probs,
            num_experts=w.shape[-1],
            top_k=None,
        )
        mask = torch.ones(w.shape[0], dtype=torch.bool, device=w.device)
        self.last_record = RoutingRecord.from_plan(plan, mask, batch_shape, padded=False)

    @torch.no_grad()
    def grow(self) -> None:
        """Freeze the current atoms and add r trainable ones (``increment_task`` [C]).
        Replaces ``lora_A`` and ``lora_B``: build the optimizer after."""
        A, B = self.atoms()
        # copies: an optimizer still holding the replaced parameters cannot move them
        self.old_lora_A = nn.Parameter(A.detach().clone(), requires_grad=False)
        self.old_lora_B = nn.Parameter(B.detach().clone(), requires_grad=False)
        self.lora_A, self.lora_B = self._new_atoms()

    def extra_repr(self) -> str:
        return (
            f"atoms={self.num_atoms}, frozen={self.num_frozen}, rank={self.rank}, "
            f"topk={self.topk}, temperature={self.temperature}, threshold={self.threshold}"
        )
