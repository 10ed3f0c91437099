"""Score functions, group-limited masking and top-k weight rules shared by the routers.

All maths runs in float32 (Megatron-Core ``moe_router_dtype``, torchtitan's fp32 gate).

Elementwise scores (sigmoid, sqrtsoftplus) are normalised in log space:
``s_i / Σ_j s_j = softmax_j(log s_j)_i`` with ``log sigmoid(ℓ) = logsigmoid(ℓ)`` and
``log sqrt(softplus(ℓ)) = ½·log softplus(ℓ)``, so the normalisation is exact for any finite
logits. (Dividing by ``sum.clamp_min(eps)`` stops normalising once every score of a token is
below eps: at logits of −65 the normalised scores summed to ~1e-8.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.core.config import RouterConfig


def router_scores(logits: Tensor, score_func: str) -> Tensor:
    """Per-expert scores ``[T, E]`` float32: softmax over experts, elementwise sigmoid, or
    elementwise ``sqrt(softplus(ℓ))`` (DeepSeek-V4's ``sqrtsoftplus``)."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"score_func: unknown {score_func!r}")


def log_scores(logits: Tensor, score_func: str) -> Tensor:
    """``log`` of :func:`router_scores`, finite for every finite logit, ``[T, E]``."""
    if score_func == "softmax":
        return logits.log_softmax(dim=-1)
    if score_func == "sigmoid":
        return F.logsigmoid(logits)
    if score_func == "sqrtsoftplus":
        # log softplus(ℓ) = log log1p(e^ℓ); below ℓ = -20, log1p(e^ℓ) = e^ℓ(1 - e^ℓ/2 + ...),
        # so log softplus(ℓ) = ℓ to within 1e-9 (and e^ℓ would underflow further down).
        safe = logits.clamp_min(-20.0)
        return 0.5 * torch.where(logits < -20.0, logits, F.softplus(safe).log())
    raise ValueError(f"score_func: unknown {score_func!r}")


def balance_probs(scores: Tensor, score_func: str, logits: Tensor | None = None) -> Tensor:
    """The per-token distribution the load-balancing losses use, ``[T, E]``.

    Softmax scores are already a distribution; elementwise scores are normalised to sum 1 per
    token (DeepSeek-V3 eq. 18's s'_{i,t}; Megatron-Core ``compute_routing_scores_for_aux_loss``),
    in log space from ``logits`` when given (exact for any finite logits).
    """
    if score_func == "softmax":
        return scores
    if logits is not None:
        return log_scores(logits, score_func).softmax(dim=-1)
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def group_limited_mask(
    selection: Tensor, n_group: int, topk_group: int, per_group: int = 2
) -> Tensor:
    """Mask experts outside the best ``topk_group`` of ``n_group`` groups with -inf.

    Each group is scored by the sum of its ``per_group`` highest selection scores (capped at
    the group size): 2 is DeepSeek-V3's code and transformers' ``DeepseekV3TopkRouter``;
    Megatron-Core's ``group_limited_topk`` uses ``top_k // topk_group``
    (``RouterConfig.group_score``).

    Args:
        selection: ``[T, E]`` float32 selection scores (bias included).
    Returns:
        ``[T, E]`` selection scores with the experts of unselected groups set to -inf.
    """
    T, E = selection.shape
    grouped = selection.view(T, n_group, E // n_group)
    best = max(1, min(per_group, E // n_group))
    group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # [T, G]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, g]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=selection.device)
    keep.scatter_(1, keep_groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return selection.masked_fill(~keep, float("-inf"))


def _selects_on_logits(cfg: RouterConfig) -> bool:
    return cfg.score_func == "softmax" and not cfg.softmax_before_topk


def topk_select(
    logits: Tensor, scores: Tensor, expert_bias: Tensor | None, cfg: RouterConfig
) -> Tensor:
    """The k experts of each token ``[T, k]`` int64, in descending selection order.

    Selection uses ``scores + expert_bias`` (softmax-after-top-k: ``logits + expert_bias``),
    restricted to the allowed groups (``n_group``/``topk_group``, scored per ``group_score``).
    """
    selection = logits if _selects_on_logits(cfg) else scores
    if expert_bias is not None:
        selection = selection + expert_bias
    if cfg.n_group is not None:
        per_group = 2 if cfg.group_score == "top2" else cfg.top_k // cfg.topk_group
        selection = group_limited_mask(selection, cfg.n_group, cfg.topk_group, per_group)
    return selection.topk(cfg.top_k, dim=-1).indices


def selected_weights(logits: Tensor, scores: Tensor, idx: Tensor, cfg: RouterConfig) -> Tensor:
    """Combine weights ``[T, k]`` float32 of the experts ``idx`` ``[T, k]``.

    Weight rules (from the unbiased scores; DeepSeek-V3 §2.1.2: the bias only decides the
    routing): softmax before top-k: ``w = p_selected`` (/ their sum if ``norm_topk_prob``);
    softmax after top-k: ``w = softmax(logits_selected)``; sigmoid / sqrtsoftplus:
    ``w = s_selected`` (/ their sum if ``norm_topk_prob``). Normalised weights are computed
    as a softmax of the selected log scores: exact for any finite logits, and exactly 1.0
    for a single expert;
    then ``× routed_scaling_factor``.
    """
    if _selects_on_logits(cfg):
        weights = logits.gather(-1, idx).softmax(dim=-1)
    elif cfg.norm_topk_prob:
        # s_i / Σ_sel s_j = softmax over the selected log scores: no sum that can underflow
        # (the expert bias or group limits may select experts whose scores are tiny)
        weights = log_scores(logits, cfg.score_func).gather(-1, idx).softmax(dim=-1)
    else:
        weights = scores.gather(-1, idx)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights


def topk_weights(
    logits: Tensor, scores: Tensor, expert_bias: Tensor | None, cfg: RouterConfig
) -> tuple[Tensor, Tensor]:
    """Token-choice selection: the k experts of each token and their combine weights.

    :func:`topk_select` then :func:`selected_weights`.

    Args:
        logits: ``[T, E]`` float32; scores: ``[T, E]`` float32 from :func:`router_scores`.
        expert_bias: ``[E]`` float32 or None.
    Returns:
        (weights ``[T, k]`` float32, expert indices ``[T, k]`` int64), experts in descending
        selection order.
    """
    idx = topk_select(logits, scores, expert_bias, cfg)
    return selected_weights(logits, scores, idx, cfg), idx


def round_robin_experts(num_tokens: int, top_k: int, num_experts: int, device) -> Tensor:
    """Forced uniform assignment ``[T, k]``: token t takes experts ``(t·k + j) mod E``.

    Every expert receives ``floor(T·k/E)`` or ``ceil(T·k/E)`` pairs, and a token's k experts
    are distinct (k <= E). For benchmarking dispatch and expert compute independently of
    the learned routing (``RouterConfig.force_uniform``).
    """
    pair = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
    return pair % num_experts
