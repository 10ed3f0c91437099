"""Aux-loss-free load balancing: the per-expert bias update (DeepSeek-V3, arXiv 2412.19437
§2.1.2; Wang et al., arXiv 2408.15664).

``b_i ← b_i + γ · sign(mean_j load_j − load_i)``, as Megatron-Core ``get_updated_expert_bias``.
The training loop calls :func:`update_expert_bias` once per optimizer step with the exact
integer counts it gathered from the layers' RoutingRecords; forward never touches the bias, so
activation checkpointing (which re-runs forward) cannot count tokens twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moelab.core.routers.token_choice import TopKRouter


@torch.no_grad()
def update_expert_bias(router: TopKRouter, counts: Tensor, rate: float | None = None) -> Tensor:
    """Apply one bias update from ``counts`` ``[E]`` int64 (summed over the step's micro-batches).

    Counts are summed over ranks when ``torch.distributed`` is initialised. The comparison with
    the mean is done in integers (``sign(Σ_j load_j − E·load_i)``) so it is exact.

    Args:
        router: a TopKRouter built with ``expert_bias=True``.
        counts: ``[E]`` integer tensor of pairs routed to each expert.
        rate: γ; defaults to ``router.config.bias_update_rate``.
    Returns:
        The updated bias ``[E]`` float32.
    Raises:
        ValueError: the router has no expert bias, or counts has the wrong shape or dtype.
    """
    if getattr(router, "expert_bias", None) is None:
        raise ValueError("router: built without expert_bias=True; nothing to update")
    E = router.config.num_experts
    if counts.shape != (E,) or counts.is_floating_point():
        raise ValueError(
            f"counts: expected an integer tensor of shape [{E}], got {counts.dtype} {tuple(counts.shape)}"
        )
    counts = counts.to(torch.int64).to(router.expert_bias.device)
    if dist.is_available() and dist.is_initialized():
        counts = counts.clone()
        dist.all_reduce(counts)
    gamma = router.config.bias_update_rate if rate is None else rate
    direction = torch.sign(counts.sum() - E * counts).to(router.expert_bias.dtype)
    router.expert_bias.add_(gamma * direction)
    return router.expert_bias
