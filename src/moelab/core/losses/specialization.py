"""Intra-layer specialization loss between co-activated experts.

Paper: Rizhen Hu, Yuan Cao, Boao Kong, Mou Sun, Kun Yuan, "Synergistic Intra- and Cross-Layer
Regularization Losses for MoE Expert Specialization", arXiv 2602.14159 (2026); earlier ICLR 2026
submission "Improving MoE Performance and Efficiency with Plug-and-Play Intra-Layer
Specialization and Cross-Layer Coupling Losses". No public code.

Follows the paper (abstract): penalise the cosine similarity between the SwiGLU activations
``a_e(x) = silu(x·W_gate^e) ⊙ (x·W_up^e)`` (the F-wide intermediate) of the routed experts that
process the *same* token; shared experts are excluded; router and architecture unchanged;
added to the load-balancing loss.

Our reading: a secondary summary of the paper gives ``R_sp(x) = Σ_l Σ_{e≠ν ∈ A(x)} cos²(z_e,
z_ν)``, so the default penalty is ``cos²`` (``penalty="square"``; ``"cos"`` and ``"relu"``
= max(cos, 0) are options). We *average* over the co-activated unordered pairs of the valid
tokens of one layer (instead of summing over ordered pairs), so the value lies in [0, 1]
(identical activations give 1, orthogonal ones 0) and the coefficient does not depend on T or
k; the model sums the per-layer values like every other aux loss. Only activations the layer
computes anyway are used; with one expert per token the loss is 0.
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
    """Mean ``φ(cos(a_i, a_j))`` over pairs of rows of the same (valid) token.

    Args:
        act_NF: ``[N, F]`` expert activations, one row per routed (token, expert) pair.
        token_idx_N: ``[N]`` int64 token of each row.
        token_mask: ``[T]`` bool valid tokens (padding excluded); None = all valid.
        penalty: ``"square"`` (cos²), ``"cos"`` or ``"relu"`` (max(cos, 0)).
    Returns:
        float32 scalar in [0, 1] (``"cos"``: [-1, 1]); 0 (attached to the graph) when no token
        has two experts.
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
    a = act_NF.float()
    cos = F.cosine_similarity(a[i], a[j], dim=-1, eps=eps)
    if penalty == "square":
        phi = cos.square()
    elif penalty == "relu":
        phi = cos.clamp_min(0.0)
    else:
        phi = cos
    return phi.mean()


class SpecializationLoss:
    """The layer-level loss object: ``loss(activations, token_idx, token_mask)``."""

    def __init__(self, penalty: str = "square") -> None:
        self.penalty = penalty

    def __call__(self, act_NF: Tensor, token_idx_N: Tensor, token_mask: Tensor) -> Tensor:
        return specialization_loss(act_NF, token_idx_N, token_mask, self.penalty)
