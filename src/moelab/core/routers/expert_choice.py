"""Expert-choice routing (Zhou et al., "Mixture-of-Experts with Expert Choice Routing",
NeurIPS 2022, arXiv 2202.09368).

Follows the paper: scores S = softmax(X·Wᵀ) over experts; each expert takes its top-C tokens by
its column of S, with C = ceil(T·k/E · capacity_factor) (capacity factor 1 by default); the
combine weight of a pair is its score. A token may get 0..E experts.

Caveat (ours, documented): an expert's choice depends on every token in the batch, including
later positions, so expert choice is not causal; use it for encoders or for training studies,
not for autoregressive generation.
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

    def plan(self, logits: Tensor) -> RoutingPlan:
        cfg = self.config
        T, E = logits.shape
        scores = router_scores(logits, "softmax")
        capacity = expert_capacity(T, cfg.top_k, E, cfg.capacity_factor or 1.0)
        weight_EC, token_EC = scores.t().topk(capacity, dim=-1)
        return RoutingPlan(
            token_idx=token_EC.reshape(-1),
            expert_idx=torch.arange(E, device=logits.device).repeat_interleave(capacity),
            weight=weight_EC.reshape(-1),
            logits=logits,
            probs=scores,
            num_experts=E,
        )
