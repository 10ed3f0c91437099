"""Cross-layer dependency (coupling) loss between adjacent MoE layers.

Paper: Rizhen Hu, Yuan Cao, Boao Kong, Mou Sun, Kun Yuan, "Synergistic Intra- and Cross-Layer
Regularization Losses for MoE Expert Specialization", arXiv 2602.14159 (2026); the ICLR 2026
submission calls it the cross-layer *dependency* loss. No public code.

Follows the paper (abstract): the loss *maximises the joint top-k routing probability of
adjacent layers*, building coherent expert pathways through depth; it does not change the
router; gradients reach both layers' routers.

``"joint_topk"`` (default) is the best available reading of the paper's Eq. 7 (a third-party
implementation that cites it; the paper's method section was not reachable): per token, the
product of the two adjacent layers' routed probability masses,
``m_l(t) = Σ_{i∈K_l(t)} p^l_i(t)``, with no log, maximised:
``L = 1 − mean_l mean_t m_l(t)·m_{l+1}(t)`` (the constant 1 keeps L in [0, 1]; the gradient is
that of −mean m_l·m_{l+1}). The product couples the layers: each layer's gradient is scaled by
the other layer's mass.

This project's variants (not the paper's):

- ``"pathway"``. The batch joint routing distribution of layers l and l+1,
  ``J = (1/T) Σ_t p^l(t) p^{l+1}(t)ᵀ`` (``[E_l, E_{l+1}]``, sums to 1), and
  ``L = 1 − Σ_i Σ_{j ∈ top-k of row i} J_ij``: the probability mass that does *not* flow
  from a layer-l expert to one of its k most frequent layer-(l+1) successors. Note that it is
  also 0 when layer l+1 collapses onto any k experts (only the balancing loss opposes that).
- ``"token"``. ``L = −mean_t log(m_l(t) · m_{l+1}(t))``. The log splits into two per-layer
  terms, so this variant has no cross-layer term: it only sharpens each router.

All are averaged over the L−1 adjacent pairs of MoE layers (over valid tokens), and use each
layer's own routed experts (``joint_topk``, ``token``) / k = the top_k of layer l+1
(``pathway``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan


def pathway_loss(p_a: Tensor, p_b: Tensor, top_k: int, token_mask: Tensor | None = None) -> Tensor:
    """``1 − Σ_i Σ_{j ∈ topk_j J_i·} J_ij`` with ``J = mean_t p_a(t) p_b(t)ᵀ``.

    Args:
        p_a, p_b: ``[T, E_a]``, ``[T, E_b]`` float32 per-token router distributions of the
            same tokens at two adjacent layers.
        top_k: successors kept per layer-l expert (``<= E_b``).
        token_mask: ``[T]`` bool valid tokens.
    Returns:
        float32 scalar in ``[0, 1 − k/E_b]`` (0 when no token is valid).
    """
    if token_mask is not None:
        p_a, p_b = p_a[token_mask], p_b[token_mask]
    n = p_a.shape[0]
    if n == 0:
        return p_a.sum() * 0.0
    J = p_a.float().t() @ p_b.float() / n
    k = min(top_k, J.shape[1])
    return 1.0 - J.topk(k, dim=-1).values.sum()


def _selected_mass(plan: RoutingPlan) -> Tensor:
    """``[T]`` Σ of the router probability over each token's routed experts."""
    T = plan.num_tokens
    sel = plan.probs[plan.token_idx, plan.expert_idx]
    return torch.zeros(T, dtype=sel.dtype, device=sel.device).index_add(0, plan.token_idx, sel)


def joint_topk_loss(
    plan_a: RoutingPlan, plan_b: RoutingPlan, token_mask: Tensor | None = None
) -> Tensor:
    """``1 − mean_t m_a(t)·m_b(t)`` over valid tokens, ``m`` the routed probability mass
    (the reading of arXiv 2602.14159 Eq. 7; float32 scalar in [0, 1], 0 when no token is
    valid)."""
    m = _selected_mass(plan_a) * _selected_mass(plan_b)
    if token_mask is not None:
        m = m[token_mask]
    if m.numel() == 0:
        return plan_a.probs.sum() * 0.0
    return 1.0 - m.mean()


def token_joint_loss(
    plan_a: RoutingPlan, plan_b: RoutingPlan, token_mask: Tensor | None = None
) -> Tensor:
    """``−mean_t log(P_a(K_a(t)) · P_b(K_b(t)))`` over valid tokens (tokens with no routed
    expert at either layer are skipped)."""
    m = _selected_mass(plan_a) * _selected_mass(plan_b)
    ok = m > 0
    if token_mask is not None:
        ok = ok & token_mask
    w = ok.to(m.dtype)  # weights instead of m[ok]: no host sync; 0 when no token counts
    return -(m.clamp_min(1e-30).log() * w).sum() / w.sum().clamp_min(1.0)


class CrossLayerLoss:
    """Model-level loss over the MoE layers' plans in depth order."""

    def __init__(self, variant: str = "joint_topk") -> None:
        if variant not in ("joint_topk", "pathway", "token"):
            raise ValueError(f"variant: must be joint_topk, pathway or token, got {variant!r}")
        self.variant = variant

    def __call__(
        self,
        plans: Sequence[RoutingPlan],
        token_mask: Tensor | None = None,
        top_k: int | Sequence[int] | None = None,
    ) -> Tensor:
        """Mean over adjacent pairs ``(plans[l], plans[l+1])``.

        Args:
            plans: the MoE layers' plans, depth order, all over the same T tokens.
            token_mask: ``[T]`` bool valid tokens.
            top_k: k of each layer (pathway); an int for all, default the mean pairs per token
                of layer l+1 rounded (k for token choice).
        Raises:
            ValueError: fewer than two plans, or plans over different T.
        """
        if len(plans) < 2:
            raise ValueError(f"plans: the cross-layer loss needs >= 2 MoE layers, got {len(plans)}")
        T = plans[0].num_tokens
        if any(p.num_tokens != T for p in plans):
            raise ValueError("plans: every layer must route the same T tokens")
        total = plans[0].probs.new_zeros(())
        for idx in range(len(plans) - 1):
            a, b = plans[idx], plans[idx + 1]
            if self.variant == "token":
                total = total + token_joint_loss(a, b, token_mask)
                continue
            if self.variant == "joint_topk":
                total = total + joint_topk_loss(a, b, token_mask)
                continue
            if top_k is None:
                k = max(1, round(b.num_pairs / max(T, 1)))
            elif isinstance(top_k, int):
                k = top_k
            else:
                k = top_k[idx + 1]
            total = total + pathway_loss(a.probs, b.probs, k, token_mask)
        return total / (len(plans) - 1)
