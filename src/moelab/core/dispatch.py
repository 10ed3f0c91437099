"""Local (single-process) token dispatch: permute rows by expert, run experts, combine.

Pairs are sorted stably by expert (torchtitan ``_local_reorder``, Megatron ``permute``), the
token rows gathered into contiguous per-expert blocks, and the expert outputs scattered back
with their combine weights in float32. The input is never written to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan


@dataclass(frozen=True)
class Dispatched:
    """Rows handed to the experts: ``x [N, D]`` sorted by expert, ``counts [E]`` int64, and the
    token index ``[N]`` and combine weight ``[N]`` float32 of every row."""

    x: Tensor
    counts: Tensor
    token_idx: Tensor
    weight: Tensor


class LocalDispatcher:
    """Sort-by-expert dispatch on one device.

    Args:
        deterministic: combine with a fixed summation order on every device. On CPU
            ``index_add_`` is already sequential; on accelerators the deterministic path sorts
            rows by token and uses ``segment_reduce`` instead of atomic adds.
    """

    def __init__(self, deterministic: bool = True) -> None:
        self.deterministic = deterministic

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> Dispatched:
        order = torch.argsort(plan.expert_idx, stable=True)
        token_idx = plan.token_idx[order]
        return Dispatched(
            x=x_TD[token_idx],
            counts=torch.bincount(plan.expert_idx, minlength=plan.num_experts),
            token_idx=token_idx,
            weight=plan.weight[order],
        )

    def combine(self, y_ND: Tensor, d: Dispatched, num_tokens: int) -> Tensor:
        """``out[t] = Σ_{pairs of t} w · y``, summed in float32, returned as ``[T, D]`` float32."""
        y = y_ND.to(d.weight.dtype) * d.weight.unsqueeze(-1)
        if y.device.type == "cpu" or not self.deterministic:
            out = y.new_zeros(num_tokens, y.shape[-1])
            return out.index_add(0, d.token_idx, y)
        return segment_combine(y, d.token_idx, num_tokens)


def segment_combine(y_ND: Tensor, token_idx: Tensor, num_tokens: int) -> Tensor:
    """Deterministic ``out[t] = Σ_{i: token_idx[i]=t} y[i]``: sort rows by token (stable) and
    sum each token's contiguous segment. ``[N, D]`` → ``[T, D]``."""
    by_token = torch.argsort(token_idx, stable=True)
    lengths = torch.bincount(token_idx, minlength=num_tokens)
    return torch.segment_reduce(y_ND[by_token], "sum", lengths=lengths, unsafe=True)
