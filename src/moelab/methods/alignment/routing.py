"""Routing seen from MESA: a forward through the top blocks that keeps each MoE layer's
plan and router input, the routing mass per expert, and the OT routing-refinement loss.

The loss (MESA stage 2, our reading [S structure, I details]): on safety tokens the router's
distribution ``P_φ,t`` is pulled towards ``π*_t ∝ P_ref,t ⊙ exp(−ĉ/ε)``, where ``P_ref,t =
softmax(W_r⁰ x_t)`` is a frozen copy of the initial router applied to the current router
input and ``ĉ_j`` is the transport cost of expert j, 0 for the selected experts: the
per-token analogue of the semi-relaxed plan of :mod:`moelab.methods.alignment.ot`. On
general tokens the target is ``P_ref,t`` itself (the routing is kept). The loss is
``KL(π*_t ‖ P_φ,t)`` averaged over tokens and layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan
from moelab.models.attention import causal_mask
from moelab.models.transformer import MoETransformer


@dataclass
class TopOutput:
    """What :func:`forward_top` returns.

    Attributes:
        logits: ``[N, V]`` logits at the requested positions (model dtype).
        plans: one :class:`RoutingPlan` per MoE layer at or above the start block (graph
            kept; tokens are the flattened ``[B·S]`` positions, padding included).
        router_inputs: the matching router inputs ``[B·S, D]`` (detached).
    """

    logits: Tensor
    plans: list[RoutingPlan]
    router_inputs: list[Tensor]


def forward_top(
    model: MoETransformer, hidden: Tensor, mask: Tensor, start_block: int, positions: Tensor
) -> TopOutput:
    """Run blocks ``start_block..`` on the cached states ``hidden [B, S, D]`` (from
    ``model.hidden_at``; ``mask [B, S]`` bool, right padding) and the LM head only at
    ``positions`` (``[N, 2]`` int64 (row, column) pairs): response-only logits, since the
    49,152-word head is most of the cost of the top blocks.

    Equals ``model(ids, mask).logits[positions[:, 0], positions[:, 1]]`` up to float
    rounding (tested).
    """
    attn_mask = causal_mask(hidden.shape[1], 0, mask, hidden.device)
    plans, inputs, handles = [], [], []
    for block in model.blocks[start_block:]:
        if block.is_moe:
            handles.append(
                block.ffn.router.register_forward_pre_hook(
                    lambda _m, args: inputs.append(args[0].detach())
                )
            )
    try:
        x = hidden
        for block in model.blocks[start_block:]:
            x, _aux, _record, plan = block(x, mask=mask, attn_mask=attn_mask, return_plan=True)
            if plan is not None:
                plans.append(plan)
    finally:
        for h in handles:
            h.remove()
    h = model.norm(x[positions[:, 0], positions[:, 1]])
    logits = model.lm_head(h)
    if model.cfg.logit_scale != 1.0:
        logits = logits * model.cfg.logit_scale
    return TopOutput(logits, plans, inputs)


def dense_weights(plan: RoutingPlan, num_tokens: int) -> Tensor:
    """The plan's combine weights as a dense ``[T, E]`` float32 matrix (0 where not routed)."""
    w = torch.zeros(num_tokens, plan.num_experts, dtype=torch.float32, device=plan.weight.device)
    return w.index_put(
        (plan.token_idx, plan.expert_idx), plan.weight.detach().float(), accumulate=True
    )


def routing_mass(plan: RoutingPlan, token_mask: Tensor) -> Tensor:
    """Each expert's share of the combine weight over the tokens ``token_mask [T]`` (bool):
    ``[E]`` float64 summing to 1 (uniform when no token is selected)."""
    w = dense_weights(plan, token_mask.numel())[token_mask].double().sum(dim=0)
    total = w.sum()
    return w / total if total > 0 else torch.full_like(w, 1.0 / w.numel())


def top_choices(plan: RoutingPlan, token_mask: Tensor) -> Tensor:
    """The selected experts ``[T', k]`` int64 of the tokens in ``token_mask [T]``, in
    descending weight (column 0 = the top-1 expert)."""
    w = dense_weights(plan, token_mask.numel())[token_mask]
    k = int(plan.top_k or (w > 0).sum(dim=1).max())
    return w.topk(k, dim=1).indices


def target_routing(ref_logits: Tensor, penalty: Tensor, epsilon: float) -> Tensor:
    """``π*_t ∝ softmax(ref_logits_t) ⊙ exp(−penalty_t/ε)``: ``[T, E]`` float32 rows summing
    to 1, from the reference router's logits ``[T, E]`` and a ``penalty`` broadcastable to
    ``[T, E]`` (the transport cost, 0 for selected experts and on general tokens; all zeros
    gives the reference routing)."""
    return torch.softmax(ref_logits.float() - penalty.float() / epsilon, dim=-1)


def routing_kl(target: Tensor, logits: Tensor) -> Tensor:
    """Mean over tokens of ``KL(target_t ‖ softmax(logits_t))`` (fp32 scalar; 0 for no
    tokens). ``target``, ``logits``: ``[T, E]``; the gradient flows into ``logits``."""
    if target.shape[0] == 0:
        return logits.sum() * 0.0
    t = target.float()
    log_t = torch.log(t.clamp_min(1e-30))
    return (t * (log_t - torch.log_softmax(logits.float(), dim=-1))).sum(dim=-1).mean()
