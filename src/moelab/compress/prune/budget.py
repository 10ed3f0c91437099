"""How many experts each MoE layer keeps: the global target, uniform budgets, and RaGEP's
rank-aware budgets (Stage 1).

RaGEP (Hu et al., "RaGEP: Rank-aware Geometric Expert Pruning for Mixture-of-Experts Language
Models", ICML 2026; code github.com/Saul-James/RaGEP, ``stage1_rank_based_budget_allocation`` of
``code/Mixtral 8x7B/ragep_mixtral_prune.py``) [C = as the authors' code does]:

- effective rank of a layer's representations: the participation ratio
  ``r_l = (tr C)² / ‖C‖_F² = (Σλ)² / Σλ²`` of their covariance ``C = E[h hᵀ] − μ μᵀ``
  (0 when C = 0) [C];
- layer score ``s_l = r_l^α`` (α = 1) [C];
- global budget ``B = ⌊ρ · Σ_l E_l⌋`` for a retention fraction ρ [C: ``int(L·E·ρ)``]; every layer
  starts at its floor ``m_l = max(min_experts, top_k_l)`` [C], then gets
  ``min(⌊(B − Σ m) · s_l / Σ s⌋, E_l − n_l)`` more [C: ``int(norm_score · remaining)``]; the
  rounding gap is closed one expert at a time, visiting layers from the highest score down and
  skipping full layers, cycling until ``Σ n_l = B`` (and, never reached from the floors, removing
  from the lowest-score layers above their floor if the sum overshoots) [C].

Choices of this project [I]: the authors raise a target below ``Σ m_l`` to ``Σ m_l``; we refuse
it (``ValueError``), as the issue asks. Layers may start with different expert counts (pruning
an already pruned model), so ``E_l``, ``top_k_l`` and the floors are per layer. Ties between
equal layer scores are broken by layer order (a stable sort). The authors call NumPy's
default sort, which is not stable in general (NumPy 2 uses SIMD sorts on AVX-512 CPUs), so
their order of tied layers depends on the machine; a stable order is this project's choice.
An all-zero score vector
(every covariance zero) falls back to equal shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def effective_rank(cov: Tensor) -> float:
    """Participation ratio ``(tr C)² / ‖C‖_F²`` of a symmetric PSD ``[D, D]`` covariance: D for
    the identity, 1 for rank one; 0 for the zero matrix.

    Raises:
        ValueError: ``cov`` is not square 2-D.
    """
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise InvalidValueError(f"cov: expected a square [D, D] matrix, got {tuple(cov.shape)}")
    c = cov.to(torch.float64)
    fro2 = float((c * c).sum())
    if fro2 == 0.0:
        return 0.0
    return float(torch.trace(c)) ** 2 / fro2


def total_budget(keep: float | int, num_experts: Sequence[int]) -> int:
    """The number of experts kept over all MoE layers.

    Args:
        keep: a float fraction ρ in (0, 1) of all routed experts (``⌊ρ · Σ E_l⌋``, as the
            authors' ``int(L·E·ρ)``) or an int absolute total in ``[1, Σ E_l)``.
        num_experts: ``E_l`` of each MoE layer.
    Raises:
        ValueError: ``keep`` outside those ranges or it rounds to no expert.
    """
    total = sum(num_experts)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise InvalidValueError(f"keep: must be a fraction in (0, 1) or an int total, got {keep!r}")
    if isinstance(keep, int):
        n = keep
        if not 1 <= n < total:
            raise InvalidValueError(
                f"keep: an absolute total must be in [1, {total - 1}] (the model has {total} "
                f"routed experts), got {n}"
            )
        return n
    if not 0.0 < keep < 1.0 or math.isnan(keep):
        raise InvalidValueError(f"keep: a fraction must be in (0, 1) (exclusive), got {keep}")
    n = int(keep * total)
    if n < 1:
        raise InvalidValueError(f"keep: {keep} of {total} experts rounds down to none")
    return n


def floors(top_k: Sequence[int], min_experts: int = 1) -> list[int]:
    """Per-layer minimum ``max(min_experts, top_k_l)`` [C]."""
    if min_experts < 1:
        raise InvalidValueError(f"min_experts: must be >= 1, got {min_experts}")
    return [max(min_experts, k) for k in top_k]


def _check_total(budget: int, num_experts: Sequence[int], low: Sequence[int]) -> None:
    if budget < sum(low):
        raise InvalidValueError(
            f"keep: a budget of {budget} experts is below the {sum(low)} needed to keep "
            f"max(min_experts, top_k) = {list(low)} per layer"
        )
    if budget > sum(num_experts):
        raise InvalidValueError(f"keep: budget {budget} exceeds the {sum(num_experts)} experts")


def uniform_budget(budget: int, num_experts: Sequence[int], low: Sequence[int]) -> list[int]:
    """Equal shares: ``⌊B / L⌋`` per layer, the remainder one each to the first layers [I]
    (capped at ``E_l``; what a cap leaves goes to the next layers).

    Raises:
        ValueError: a layer's share is below its floor, naming the layer.
    """
    _check_total(budget, num_experts, low)
    L = len(num_experts)
    n = [min(budget // L + (1 if i < budget % L else 0), num_experts[i]) for i in range(L)]
    short = budget - sum(n)
    for i in range(L):
        add = min(short, num_experts[i] - n[i])
        n[i] += add
        short -= add
    for i, (ni, m) in enumerate(zip(n, low, strict=True)):
        if ni < m:
            raise InvalidValueError(
                f"keep: the uniform budget gives MoE layer {i} {ni} experts, below its "
                f"max(min_experts, top_k) = {m}"
            )
    return n


def rank_budget(
    budget: int,
    num_experts: Sequence[int],
    low: Sequence[int],
    ranks: Sequence[float],
    alpha: float = 1.0,
) -> list[int]:
    """RaGEP Stage 1: shares proportional to ``r_l^α`` above the floors, the authors' rounding.

    Args:
        budget: B, experts kept in total.
        num_experts: E_l per MoE layer.
        low: floors m_l (:func:`floors`).
        ranks: effective ranks r_l (>= 0).
        alpha: exponent α (>= 0).
    Returns:
        ``n_l`` with ``Σ n_l = B`` and ``m_l <= n_l <= E_l``.
    Raises:
        ValueError: B below Σ m_l or above Σ E_l, bad lengths, negative ranks.
    """
    L = len(num_experts)
    if not (len(low) == len(ranks) == L):
        raise InvalidValueError("ranks, low, num_experts: need one entry per MoE layer")
    if any(r < 0 or math.isnan(r) for r in ranks):
        raise InvalidValueError(f"ranks: must be >= 0, got {list(ranks)}")
    _check_total(budget, num_experts, low)
    scores = [float(r) ** alpha for r in ranks]
    total = sum(scores)
    share = [s / total for s in scores] if total > 0 else [1.0 / L] * L
    n = list(low)
    remaining = budget - sum(n)
    if remaining > 0:
        for i in range(L):
            n[i] += min(int(share[i] * remaining), num_experts[i] - n[i])
    diff = budget - sum(n)
    order = sorted(range(L), key=lambda i: scores[i])  # ascending, stable
    while diff != 0:
        if diff > 0:
            for i in reversed(order):
                if n[i] < num_experts[i]:
                    n[i] += 1
                    diff -= 1
                    if diff == 0:
                        break
        else:
            for i in order:
                if n[i] > low[i]:
                    n[i] -= 1
                    diff += 1
                    if diff == 0:
                        break
    return n
