"""GRACE: an ε-ball codebook on one layer (Hartvigsen et al., "Aging with GRACE: Lifelong
Model Editing with Discrete Key-Value Adaptors", NeurIPS 2023, arXiv 2211.11031).

Each edit stores a key (the layer's input at the edit prompt's last token, as GRACE), a value
(the layer's output there, trained by cross-entropy from the layer's own output) and a
radius; a token whose input lies within the radius of a key gets that key's value instead of
the layer's output (nearest key among those in range). This project's reading [I]: the
radius is relative, ``ε·‖key‖`` (activation norms differ across layers and models), and
GRACE's ball expansion/splitting when keys of new edits overlap is left out: every edit adds
an entry. Parameters per edit: ``d_in + d_out + 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.methods.editing.layer import EditBank


class GraceBank(EditBank):
    """Frozen entries: buffers ``keys [E, d_in]``, ``values [E, d_out]``, ``eps [E]``.
    The score is ``-‖a − key‖ / ‖key‖``, the threshold ``-ε``."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.params_per_edit = d_in + d_out + 1
        self.register_buffer("keys", torch.zeros(0, d_in))
        self.register_buffer("values", torch.zeros(0, d_out))
        self.register_buffer("radii", torch.zeros(0))
        self.pending: nn.Parameter | None = None
        self._pending_key: Tensor | None = None

    @property
    def num_edits(self) -> int:
        return self.keys.shape[0]

    def scores(self, a: Tensor) -> Tensor:
        keys = self.keys.float()
        return -torch.cdist(a.float(), keys) / keys.norm(dim=-1).clamp_min(1e-12)

    def thresholds(self) -> Tensor:
        return -self.radii

    def outputs(self, a: Tensor, base: Tensor, idx: Tensor) -> Tensor:
        return self.values[idx].to(base.dtype)

    def start(self, a: Tensor, layer: nn.Linear) -> list[nn.Parameter]:
        self._pending_key = a[0].float()
        with torch.no_grad():
            value = layer(a[0].to(layer.weight.dtype)).float()
        self.pending = nn.Parameter(value)
        return [self.pending]

    def pending_outputs(self, a: Tensor, base: Tensor) -> Tensor:
        return self.pending.expand(a.shape[0], -1)

    def commit(self) -> None:
        self._append(keys=self._pending_key, values=self.pending, radii=torch.tensor(self.eps))
        self.pending, self._pending_key = None, None
