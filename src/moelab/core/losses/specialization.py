"""Intra-layer specialization loss between co-activated experts.

Paper: Rizhen Hu, Yuan Cao, Boao Kong, Mou Sun, Kun Yuan, "Synergistic Intra- and Cross-Layer
Regularization Losses for MoE Expert Specialization", arXiv 2602.14159 (2026); earlier ICLR 2026
submission "Improving MoE Performance and Efficiency with Plug-and-Play Intra-Layer
Specialization and Cross-Layer Coupling Losses". No public code.

Follows the paper (abstract): penalise the cosine similarity between the SwiGLU activations
``a_e(x) = silu(x·W_gate^e) ⊙ (x·W_up^e)`` (the F-wide intermediate) of the routed experts that
process the *same* token; shared experts are excluded; router and architecture unchanged;
added to the load-balancing loss.

Follows the paper's R_sp as a secondary summary gives it: ``R_sp(x) = Σ_{e≠ν ∈ A(x)}
φ(cos(a_e(x), a_ν(x)))`` over the *ordered* pairs of co-activated routed experts of token x,
then averaged over the layer's valid tokens (a token with one expert contributes 0); the
model sums the per-layer values like every other aux loss. φ defaults to cos²
(``penalty="square"``; ``"cos"`` and ``"relu"`` = max(cos, 0) are options). Only activations
the layer computes anyway are used.

Coefficient conversion: moelab before this form averaged φ over unordered pairs. At fixed k a
token has k(k−1) ordered pairs, so this value is k(k−1) times that mean (2× at k=2): a
coefficient λ_old of the old form corresponds to λ_old / (k(k−1)) here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def coactivated_pairs(token_idx_N: Tensor) -> tuple[Tensor, Tensor]:
    """Row index pairs ``(i, j)``, ``i`` before ``j``, of rows that belong to the same token.

    Args:
        token_idx_N: ``[N]`` int64 token of each row (any order, e.g. sorted by expert).
    Returns:
        two ``[P]`` int64 tensors of row indices; ``P = Σ_t n_t(n_t−1)/2``.
    """
    N = token_idx_N.shape[0]
    dev = token_idx_N.device
    if N < 2:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty
    order = torch.argsort(token_idx_N, stable=True)
    tok = token_idx_N[order]
    counts = torch.bincount(tok)
    n_max = int(counts.max())
    left, right = [], []
    for d in range(1, n_max):
        same = tok[:-d] == tok[d:]
        idx = same.nonzero(as_tuple=True)[0]
        left.append(order[idx])
        right.append(order[idx + d])
    if not left:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty
    return torch.cat(left), torch.cat(right)


def specialization_loss(
    act_NF: Tensor,
    token_idx_N: Tensor,
    token_mask: Tensor | None = None,
    penalty: str = "square",
    eps: float = 1e-8,
) -> Tensor:
    """``R_sp``: per token, ``Σ φ(cos(a_i, a_j))`` over ordered pairs of its rows; mean over
    valid tokens.

    Args:
        act_NF: ``[N, F]`` expert activations, one row per routed (token, expert) pair.
        token_idx_N: ``[N]`` int64 token of each row.
        token_mask: ``[T]`` bool valid tokens (padding excluded); None = all valid.
        penalty: ``"square"`` (cos²), ``"cos"`` or ``"relu"`` (max(cos, 0)).
    Returns:
        float32 scalar in ``[0, n(n−1)]`` for tokens of at most n experts (``"cos"`` may be
        negative); 0 (attached to the graph) when no token has two experts.
    Raises:
        ValueError: unknown penalty or mismatched shapes.
    """
    if penalty not in ("square", "cos", "relu"):
        raise ValueError(f"penalty: must be square, cos or relu, got {penalty!r}")
    if act_NF.dim() != 2 or token_idx_N.shape != (act_NF.shape[0],):
        raise ValueError(
            f"act_NF [N, F] and token_idx_N [N] must agree, got {tuple(act_NF.shape)} and "
            f"{tuple(token_idx_N.shape)}"
        )
    i, j = coactivated_pairs(token_idx_N)
    if token_mask is not None and i.numel():
        keep = token_mask[token_idx_N[i]]
        i, j = i[keep], j[keep]
    if i.numel() == 0:
        return act_NF.float().sum() * 0.0
    n_tokens = (
        token_mask.sum().clamp_min(1) if token_mask is not None else token_idx_N.unique().numel()
    )
    a = act_NF.float()
    cos = F.cosine_similarity(a[i], a[j], dim=-1, eps=eps)
    if penalty == "square":
        phi = cos.square()
    elif penalty == "relu":
        phi = cos.clamp_min(0.0)
    else:
        phi = cos
    # Each unordered pair stands for the two ordered pairs (e, ν) and (ν, e).
    return 2.0 * phi.sum() / n_tokens


class SpecializationLoss:
    """The layer-level loss object: ``loss(activations, token_idx, token_mask)``."""

    def __init__(self, penalty: str = "square") -> None:
        self.penalty = penalty

    def __call__(self, act_NF: Tensor, token_idx_N: Tensor, token_mask: Tensor) -> Tensor:
        return specialization_loss(act_NF, token_idx_N, token_mask, self.penalty)
