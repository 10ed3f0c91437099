"""Token-choice top-k routing (Shazeer et al. 2017; Switch/GShard capacity; DeepSeek-V3 options).

Follows Megatron-Core ``topk_routing_with_score_function`` and the Hugging Face routers of
Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3: softmax or sigmoid scores, softmax before or after
top-k, normalised top-k weights, routed scaling factor, group-limited selection, and the
aux-loss-free selection bias (arXiv 2412.19437 §2.1.2). Dropless by default; with a capacity
factor, over-full experts drop their lowest-priority pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.config import RouterConfig
from moelab.core.plan import RoutingPlan
from moelab.core.routers.base import Router
from moelab.core.routers.capacity import capacity_keep_mask, expert_capacity
from moelab.core.routers.scores import balance_probs, router_scores, topk_weights


class TopKRouter(Router):
    """Each token picks its k experts.

    Buffers:
        expert_bias: ``[E]`` float32 selection bias (only with ``config.expert_bias``); updated
            by :func:`moelab.core.routers.bias.update_expert_bias`, never in forward.
    """

    def __init__(self, config: RouterConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__(config, hidden_size, init_std)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def plan(self, logits: Tensor) -> RoutingPlan:
        """Route ``logits`` ``[T, E]`` float32 to a plan of up to T·k pairs (token-major)."""
        cfg = self.config
        T, E = logits.shape
        scores = router_scores(logits, cfg.score_func)
        weights_Tk, idx_Tk = topk_weights(logits, scores, self.expert_bias, cfg)
        token_idx = torch.arange(T, device=logits.device).repeat_interleave(cfg.top_k)
        expert_idx = idx_Tk.reshape(-1)
        weight = weights_Tk.reshape(-1)
        dropped = 0
        if cfg.capacity_factor is not None and T > 0:
            capacity = expert_capacity(T, cfg.top_k, E, cfg.capacity_factor)
            if cfg.drop_policy == "probs":
                priority = weight.detach()
            else:
                priority = -torch.arange(weight.shape[0], device=logits.device, dtype=torch.float32)
            keep = capacity_keep_mask(expert_idx, priority, E, capacity)
            dropped = int((~keep).sum())
            if dropped:
                token_idx, expert_idx, weight = token_idx[keep], expert_idx[keep], weight[keep]
        return RoutingPlan(
            token_idx=token_idx,
            expert_idx=expert_idx,
            weight=weight,
            logits=logits,
            probs=balance_probs(scores, cfg.score_func),
            num_experts=E,
            dropped=dropped,
            top_k=None if dropped else cfg.top_k,
        )
