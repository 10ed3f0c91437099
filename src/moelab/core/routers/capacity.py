"""Expert capacity and token dropping (GShard / Switch Transformer; Megatron-Core's policies)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert may take: ``ceil(T·k/E · capacity_factor)`` clamped to ``[1, T]``.

    Megatron-Core ``get_capacity`` without ``min_capacity``; the clamp to T is ours (an expert
    can never take a token twice). Returns 0 when T = 0.
    """
    if num_tokens == 0:
        return 0
    cap = math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    return max(1, min(cap, num_tokens))


def capacity_keep_mask(
    expert_idx: Tensor, priority: Tensor, num_experts: int, capacity: int
) -> Tensor:
    """Which pairs survive when each expert keeps at most ``capacity`` of them.

    Args:
        expert_idx: ``[N]`` int64 expert of each pair, pairs in token-major order.
        priority: ``[N]`` float32, higher is kept first (the combine weight for the
            ``probs`` policy, ``-pair_index`` for the ``position`` policy).
        capacity: pairs per expert to keep.
    Returns:
        ``[N]`` bool keep mask.
    """
    n = expert_idx.shape[0]
    by_priority = torch.argsort(priority, descending=True, stable=True)
    order = by_priority[torch.argsort(expert_idx[by_priority], stable=True)]
    counts = torch.bincount(expert_idx, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=expert_idx.device) - starts[expert_idx[order]]
    keep = torch.empty(n, dtype=torch.bool, device=expert_idx.device)
    keep[order] = rank_sorted < capacity
    return keep
