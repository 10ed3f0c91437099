"""Per-expert GPTQ Hessians ``H_e = (2 / n_e) Σ_{x routed to e} x xᵀ``, streamed.

GPTQ (arXiv 2210.17323) minimises ``‖W X − Ŵ X‖²`` per linear layer, whose Hessian is
``2 X Xᵀ``; for an MoE expert only the rows the router sends to it count (the research notes'
"per-expert H from routed tokens only"). The sums are kept in float64 with exact integer
counts per expert, so accumulating over many calls (including calls where an expert receives
a single token, or none) gives the same ``H`` as one computation on the stacked rows, and the
normalisation by ``n_e`` happens once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


class HessianAccumulator:
    """Streaming ``Σ x xᵀ`` and row counts for E experts of input width I.

    Attributes:
        sums: ``[E, I, I]`` float64.
        counts: ``[E]`` int64 rows seen per expert.
        abs_sums: ``[E, I]`` float64 ``Σ |x|`` per expert (TileQ's AWQ-style input scale).
    """

    def __init__(self, num_experts: int, in_features: int, device=None) -> None:
        self.sums = torch.zeros(
            num_experts, in_features, in_features, dtype=torch.float64, device=device
        )
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.abs_sums = torch.zeros(num_experts, in_features, dtype=torch.float64, device=device)

    def add(self, x_N: Tensor, counts: Tensor) -> None:
        """Add rows sorted by expert: ``x_N [N, I]``, ``counts [E]`` int64 (sums to N).

        Raises:
            ValueError: shapes disagree.
        """
        E, I = self.sums.shape[0], self.sums.shape[1]  # noqa: E741
        if x_N.dim() != 2 or x_N.shape[1] != I or counts.shape != (E,):
            raise InvalidValueError(
                f"x_N, counts: expected [N, {I}] and [{E}], got {tuple(x_N.shape)}, {tuple(counts.shape)}"
            )
        if int(counts.sum()) != x_N.shape[0]:
            raise InvalidValueError(f"counts: sum {int(counts.sum())} != rows {x_N.shape[0]}")
        x = x_N.to(torch.float64)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c:
                xe = x[start : start + c]
                self.sums[e].addmm_(xe.T, xe)
                self.abs_sums[e] += xe.abs().sum(0)
                start += c
        self.counts += counts.to(self.counts.device)

    def hessians(self) -> Tensor:
        """``[E, I, I]`` float64 ``(2/n_e) Σ x xᵀ`` (zeros for an expert that saw no row)."""
        n = self.counts.clamp_min(1).to(torch.float64)
        return 2.0 * self.sums / n.view(-1, 1, 1)

    def mean_abs(self) -> Tensor:
        """``[E, I]`` float64 ``mean_t |x_{e,t}|`` over each expert's own rows (zeros for an
        expert that saw no row)."""
        return self.abs_sums / self.counts.clamp_min(1).to(torch.float64).unsqueeze(-1)

    def pooled(self) -> Tensor:
        """``[I, I]`` float64 ``(2/Σn) Σ_e Σ x xᵀ``, the layer-shared second moment over all
        routed rows (what the low-rank compensation weights with)."""
        n = max(int(self.counts.sum()), 1)
        return 2.0 * self.sums.sum(0) / n
