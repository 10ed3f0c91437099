"""Effective rank of a representation matrix.

Roy & Vetterli, "The effective rank: A measure of effective dimensionality", EUSIPCO 2007:
``erank(A) = exp(H(p))`` with ``p_k = σ_k / Σ_j σ_j`` the normalised singular values and
``H(p) = -Σ_k p_k ln p_k`` (``0 ln 0 = 0``). It lies in ``[1, min(T, D)]``; 1 for rank one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def effective_rank(x: Tensor, center: bool = False) -> float:
    """Effective rank (Roy & Vetterli 2007) of ``x`` ``[T, D]`` (leading dims are flattened).

    ``exp(-Σ_k p_k ln p_k)`` with ``p_k = σ_k / Σ σ``; computed in float64. With
    ``center=True`` the column means are subtracted first (the rank of the covariance spread,
    not in the original definition).

    Raises:
        ValueError: when ``x`` has fewer than 2 dims or no element, or is all zeros (the
            effective rank of the zero matrix is undefined).
    """
    if x.dim() < 2:
        raise ValueError(f"x must be [T, D] (or [..., D]), got {tuple(x.shape)}")
    m = x.detach().reshape(-1, x.shape[-1]).double().cpu()
    if m.numel() == 0:
        raise ValueError(f"x is empty, shape {tuple(x.shape)}")
    if center:
        m = m - m.mean(0, keepdim=True)
    s = torch.linalg.svdvals(m)
    total = float(s.sum())
    if total <= 0:
        raise ValueError("effective rank is undefined for an all-zero matrix")
    p = s / total
    p = p[p > 0]
    return math.exp(float(-(p * p.log()).sum()))
