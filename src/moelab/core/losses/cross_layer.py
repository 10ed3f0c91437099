"""Cross-layer dependency (coupling) loss between adjacent MoE layers.

Paper: Rizhen Hu, Yuan Cao, Boao Kong, Mou Sun, Kun Yuan, "Synergistic Intra- and Cross-Layer
Regularization Losses for MoE Expert Specialization", arXiv 2602.14159 (2026); the ICLR 2026
submission calls it the cross-layer *dependency* loss. No public code.

Follows the paper (abstract): the loss *maximises the joint top-k routing probability of
adjacent layers*, building coherent expert pathways through depth; it does not change the
router; gradients reach both layers' routers.

The exact formula is not public; both formulations here are our reading:

- ``"pathway"`` (default). The batch joint routing distribution of layers l and l+1,
  ``J = (1/T) Σ_t p^l(t) p^{l+1}(t)ᵀ`` (``[E_l, E_{l+1}]``, sums to 1), and
  ``L = 1 − Σ_i Σ_{j ∈ top-k of row i} J_ij``: the probability mass that does *not* flow
  from a layer-l expert to one of its k most frequent layer-(l+1) successors. It is 0 iff
  every layer-l expert hands its tokens to at most k successors — coherent pathways.
- ``"token"``. ``L = −mean_t log(Σ_{i∈K_l(t)} p^l_i(t) · Σ_{j∈K_{l+1}(t)} p^{l+1}_j(t))``,
  the per-token joint probability of the two chosen top-k sets (as if independent).

Why pathway is the default: the log of the per-token product splits into two separate
per-layer terms, so the "token" variant has no cross-layer term at all — it only sharpens each
router — while the paper's stated purpose is coupling adjacent layers into stable pathways,
which only the joint distribution over (layer-l expert, layer-(l+1) expert) expresses.

Both are averaged over the L−1 adjacent pairs of MoE layers (over valid tokens), and use k =
the top_k of layer l+1 (pathway) / each layer's own routed experts (token).
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

    def __init__(self, variant: str = "pathway") -> None:
        if variant not in ("pathway", "token"):
            raise ValueError(f"variant: must be pathway or token, got {variant!r}")
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
            if top_k is None:
                k = max(1, round(b.num_pairs / max(T, 1)))
            elif isinstance(top_k, int):
                k = top_k
            else:
                k = top_k[idx + 1]
            total = total + pathway_loss(a.probs, b.probs, k, token_mask)
        return total / (len(plans) - 1)
