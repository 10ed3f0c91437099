"""Expert-choice routing (Zhou et al., "Mixture-of-Experts with Expert Choice Routing",
NeurIPS 2022, arXiv 2202.09368).

Follows the paper: scores S = softmax(X·Wᵀ) over experts; each expert takes its top-C tokens by
its column of S, with C = ceil(T·k/E · capacity_factor) (capacity factor 1 by default); the
combine weight of a pair is its score. A token may get 0..E experts.

Ours: padding (``token_mask`` False) takes no slot: C is computed from the number of real
tokens and padded tokens are never chosen, so real tokens are routed exactly as without the
padding (computing C from the real tokens reads their count on the host).

Caveat (ours, documented): an expert's choice depends on every token in the batch, including
later positions, so expert choice is not causal; use it for encoders or for training studies,
not for autoregressive generation (the KV-cache path of :class:`moelab.models.MoETransformer`
refuses it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan
from moelab.core.routers.base import Router
from moelab.core.routers.capacity import expert_capacity
from moelab.core.routers.scores import router_scores


class ExpertChoiceRouter(Router):
    """Each expert picks its top-capacity tokens; gives E·C pairs (expert-major)."""

    masks_padding = True

    def plan(self, logits: Tensor, token_mask: Tensor | None = None) -> RoutingPlan:
        """Route ``logits`` ``[T, E]``; ``token_mask`` ``[T]`` bool marks real tokens."""
        cfg = self.config
        T, E = logits.shape
        scores = router_scores(logits, "softmax")
        n_real = T if token_mask is None else int(token_mask.sum())
        capacity = expert_capacity(n_real, cfg.top_k, E, cfg.capacity_factor or 1.0)
        choice = scores if token_mask is None else scores.masked_fill(~token_mask[:, None], -1.0)
        weight_EC, token_EC = choice.t().topk(capacity, dim=-1)
        return RoutingPlan(
            token_idx=token_EC.reshape(-1),
            expert_idx=torch.arange(E, device=logits.device).repeat_interleave(capacity),
            weight=weight_EC.reshape(-1),
            logits=logits,
            probs=scores,
            num_experts=E,
        )
