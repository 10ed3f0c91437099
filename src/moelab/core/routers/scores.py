"""Score functions, group-limited masking and top-k weight rules shared by the routers.

All maths runs in float32 (Megatron-Core ``moe_router_dtype``, torchtitan's fp32 gate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.config import RouterConfig


def router_scores(logits: Tensor, score_func: str) -> Tensor:
    """Per-expert scores ``[T, E]`` float32: softmax over experts, or elementwise sigmoid."""
    return logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()


def balance_probs(scores: Tensor, score_func: str) -> Tensor:
    """The per-token distribution the load-balancing losses use, ``[T, E]``.

    Softmax scores are already a distribution; sigmoid scores are normalised to sum 1 per token
    (DeepSeek-V3 eq. 18's s'_{i,t}; Megatron-Core ``compute_routing_scores_for_aux_loss``).
    """
    if score_func == "softmax":
        return scores
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def group_limited_mask(selection: Tensor, n_group: int, topk_group: int) -> Tensor:
    """Mask experts outside the best ``topk_group`` of ``n_group`` groups with -inf.

    Each group is scored by the sum of its two highest selection scores (one when a group has a
    single expert), as DeepSeek-V3 (``DeepseekV3TopkRouter``; Megatron ``group_limited_topk``).

    Args:
        selection: ``[T, E]`` float32 selection scores (bias included).
    Returns:
        ``[T, E]`` selection scores with the experts of unselected groups set to -inf.
    """
    T, E = selection.shape
    grouped = selection.view(T, n_group, E // n_group)
    best = min(2, E // n_group)
    group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # [T, G]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, g]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=selection.device)
    keep.scatter_(1, keep_groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return selection.masked_fill(~keep, float("-inf"))


def topk_weights(
    logits: Tensor, scores: Tensor, expert_bias: Tensor | None, cfg: RouterConfig
) -> tuple[Tensor, Tensor]:
    """Token-choice selection: the k experts of each token and their combine weights.

    Selection uses ``scores + expert_bias`` (softmax-after-top-k: ``logits + expert_bias``),
    restricted to the allowed groups; the weights come from the unbiased scores (DeepSeek-V3
    §2.1.2: the bias only decides the routing). Weight rules:
    softmax before top-k: ``w = p_selected`` (/ their sum if ``norm_topk_prob``);
    softmax after top-k: ``w = softmax(logits_selected)``;
    sigmoid: ``w = s_selected`` (/ their sum if ``norm_topk_prob``); then ``× routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` float32; scores: ``[T, E]`` float32 from :func:`router_scores`.
        expert_bias: ``[E]`` float32 or None.
    Returns:
        (weights ``[T, k]`` float32, expert indices ``[T, k]`` int64), experts in descending
        selection order.
    """
    after = cfg.score_func == "softmax" and not cfg.softmax_before_topk
    selection = logits if after else scores
    if expert_bias is not None:
        selection = selection + expert_bias
    if cfg.n_group is not None:
        selection = group_limited_mask(selection, cfg.n_group, cfg.topk_group)
    idx = selection.topk(cfg.top_k, dim=-1).indices
    if after:
        weights = logits.gather(-1, idx).softmax(dim=-1)
    else:
        weights = scores.gather(-1, idx)
        if cfg.norm_topk_prob:
            # clamp (not +eps) so a single selected expert gets a weight of exactly 1.0
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, idx
