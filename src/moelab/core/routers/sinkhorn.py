"""Sinkhorn routing (Megatron-Core's ``moe_router_load_balancing_type="sinkhorn"``; the
balanced assignment of BASE layers, Lewis et al. 2021, arXiv 2103.16716, computed with
Sinkhorn iterations as in Clark et al. 2022, arXiv 2202.01169).

In training each token's k experts are the top-k of the Sinkhorn-balanced matrix
``diag(d0) · exp(ℓ) · diag(d1)`` whose rows sum to 1/T and columns to 1/E (no gradient
through the selection); the combine weights are the router's own scores at those experts.
At evaluation the selection is the plain top-k of the scores. Sinkhorn balances the load
without an aux loss.

Follows Megatron-Core's ``sinkhorn``: ``d0 = 1/T · 1/(Σ_e d1_e c_te + ε)``,
``d1 = 1/E · 1/(Σ_t d0_t c_te + ε)`` with ``ε = 1e-8``, iterated until
``mean |d1 − d1_old| < tol`` (1e-4). Megatron's score function is fixed (sigmoid for k = 1,
softmax for k > 1, weights not renormalised); here the score function and weight rule are
``RouterConfig``'s, which gives Megatron's with ``score_func="sigmoid"`` (k = 1) or
``score_func="softmax", norm_topk_prob=False`` (k > 1).

Ours: the cost ``exp(ℓ)`` is computed as ``exp(ℓ − max ℓ)``, which leaves the balanced matrix
unchanged (d0 absorbs the scale; only ε's relative size changes) and cannot overflow; the
iteration stops after at most ``max_iter`` (1000) rounds. The convergence test reads a value
on the host once per round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.routers.token_choice import TopKRouter


@torch.no_grad()
def sinkhorn(logits: Tensor, tol: float = 1e-4, max_iter: int = 1000) -> Tensor:
    """Sinkhorn-balance ``exp(logits)`` ``[T, E]`` to rows summing 1/T and columns 1/E.

    Returns the balanced ``[T, E]`` float32 matrix (no gradient).
    """
    cost = (logits.float() - logits.float().max()).exp()
    T, E = cost.shape
    eps = 1e-8
    d0 = torch.ones(T, device=cost.device)
    d1 = torch.ones(E, device=cost.device)
    for _ in range(max_iter):
        d1_old = d1
        d0 = (1.0 / T) / ((cost * d1).sum(1) + eps)
        d1 = (1.0 / E) / ((d0.unsqueeze(1) * cost).sum(0) + eps)
        if float((d1_old - d1).abs().mean()) <= tol:
            break
    return d1 * cost * d0.unsqueeze(1)


class SinkhornRouter(TopKRouter):
    """Token choice whose training-time selection is the top-k of the Sinkhorn-balanced
    logits (see the module docstring)."""

    def select(self, logits: Tensor, scores: Tensor) -> Tensor:
        if self.training and logits.shape[0] > 0:
            return sinkhorn(logits).topk(self.config.top_k, dim=-1).indices
        return scores.topk(self.config.top_k, dim=-1).indices
