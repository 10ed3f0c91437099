"""Token-choice top-k routing (Shazeer et al. 2017; Switch/GShard capacity; DeepSeek-V3 options).

Follows Megatron-Core ``topk_routing_with_score_function`` and the Hugging Face routers of
Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3: softmax, sigmoid or sqrtsoftplus scores, softmax
before or after top-k, normalised top-k weights, routed scaling factor, group-limited
selection, and the aux-loss-free selection bias (arXiv 2412.19437 §2.1.2). Dropless by
default; with a capacity factor, over-full experts drop their lowest-priority pairs.

Padding (``token_mask`` False) takes no capacity: capacity is computed from the number of
real tokens, padded pairs rank below every real pair and are dropped, so real tokens are
routed exactly as without the padding.

Router replay (:mod:`moelab.core.replay`) and forced routing (``MoELayer.forward(...,
expert_ids=...)``) fix the selected experts to given ones; the combine weights are recomputed
from the current router (so they keep their gradient), and capacity dropping is re-applied.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.config import RouterConfig
from moelab.core.plan import RoutingPlan
from moelab.core.routers.base import Router
from moelab.core.routers.capacity import capacity_keep_mask, expert_capacity
from moelab.core.routers.scores import (
    balance_probs,
    round_robin_experts,
    router_scores,
    selected_weights,
    topk_select,
)


class TopKRouter(Router):
    """Each token picks its k experts.

    Buffers:
        expert_bias: ``[E]`` float32 selection bias (only with ``config.expert_bias``); updated
            by :func:`moelab.core.routers.bias.update_expert_bias`, never in forward; stays
            float32 whatever the model dtype.

    Attributes:
        replay: a :class:`moelab.core.replay.RouterReplay` (None = route normally).
    """

    masks_padding = True

    def __init__(self, config: RouterConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__(config, hidden_size, init_std)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None
        self.replay = None

    def select(self, logits: Tensor, scores: Tensor) -> Tensor:
        """The learned selection ``[T, k]`` int64 (subclasses override; see Sinkhorn)."""
        return topk_select(logits, scores, self.expert_bias, self.config)

    def plan(
        self, logits: Tensor, token_mask: Tensor | None = None, forced: Tensor | None = None
    ) -> RoutingPlan:
        """Route ``logits`` ``[T, E]`` float32 to a plan of up to T·k pairs (token-major).

        ``token_mask`` ``[T]`` bool (True = real token) only matters with a capacity factor.
        ``forced`` ``[T, k]`` int64 replaces the selection (forced routing from outside,
        already checked by :func:`moelab.core.plan.check_expert_ids`); it takes precedence
        over router replay.
        """
        cfg = self.config
        T, E = logits.shape
        scores = router_scores(logits, cfg.score_func)
        replay = self.replay
        if forced is not None:
            idx_Tk = forced
        elif replay is not None and replay.mode == "replay":
            idx_Tk = replay.replayed(T, cfg.top_k, E, logits.device)
        elif cfg.force_uniform:
            idx_Tk = round_robin_experts(T, cfg.top_k, E, logits.device)
        else:
            idx_Tk = self.select(logits, scores)
        if replay is not None and replay.mode == "record":
            replay.store(idx_Tk)
        weights_Tk = selected_weights(logits, scores, idx_Tk, cfg)
        token_idx = torch.arange(T, device=logits.device).repeat_interleave(cfg.top_k)
        expert_idx = idx_Tk.reshape(-1)
        weight = weights_Tk.reshape(-1)
        dropped = 0
        uniform = True
        if cfg.capacity_factor is not None and T > 0:
            token_idx, expert_idx, weight, dropped = self._apply_capacity(
                token_idx, expert_idx, weight, token_mask
            )
            uniform = token_idx.shape[0] == T * cfg.top_k
        return RoutingPlan(
            token_idx=token_idx,
            expert_idx=expert_idx,
            weight=weight,
            logits=logits,
            probs=balance_probs(scores, cfg.score_func, logits),
            num_experts=E,
            dropped=dropped,
            top_k=cfg.top_k if uniform else None,
        )

    def _apply_capacity(
        self, token_idx: Tensor, expert_idx: Tensor, weight: Tensor, token_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, int]:
        cfg = self.config
        E = cfg.num_experts
        n = weight.shape[0]
        if cfg.drop_policy == "probs":
            priority = weight.detach().float()
        else:
            priority = -torch.arange(n, device=weight.device, dtype=torch.float32)
        if token_mask is None:
            n_real = n // cfg.top_k
            valid_pair = None
        else:
            n_real = int(token_mask.sum())
            valid_pair = token_mask[token_idx]
            priority = priority.masked_fill(~valid_pair, float("-inf"))
        capacity = expert_capacity(n_real, cfg.top_k, E, cfg.capacity_factor)
        keep = capacity_keep_mask(expert_idx, priority, E, capacity)
        if valid_pair is not None:
            dropped = int((valid_pair & ~keep).sum())
            keep = keep & valid_pair
        else:
            dropped = int((~keep).sum())
        if bool(keep.all()):
            return token_idx, expert_idx, weight, dropped
        return token_idx[keep], expert_idx[keep], weight[keep], dropped
