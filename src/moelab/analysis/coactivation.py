"""Expert co-activation: how often two experts are selected for the same token.

The co-selection (co-activation) matrix ``C[i, j] = #{tokens routed to both i and j}`` and its
conditional form ``P(j | i) = C[i, j] / #{tokens routed to i}`` follow the co-activation analysis
of expert-parallel placement and pruning work, e.g. "Exploiting Inter-Layer Expert Affinity for
Accelerating MoE Inference" (Yao et al., IPDPS 2024, arXiv:2401.08383) and the co-activation
graphs of MoE-Infinity (Xue et al., 2024, arXiv:2401.14361).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.analysis._common import check_records
from moelab.core.telemetry import RoutingRecord


def selection_matrix(record: RoutingRecord) -> Tensor:
    """``[T, E]`` float64 0/1 indicator: token t was dispatched to expert e (valid pairs only)."""
    T = record.probs.shape[0]
    A = torch.zeros(T, record.num_experts, dtype=torch.float64)
    if record.token_idx.numel():
        A[record.token_idx.long().cpu(), record.expert_idx.long().cpu()] = 1.0
    return A


def coactivation_counts(records: Sequence[RoutingRecord]) -> tuple[Tensor, Tensor]:
    """Co-selection counts of one layer, summed over its records.

    ``C = Aᵀ A`` with ``A [T, E]`` the 0/1 token-expert selection indicator of each record; the
    off-diagonal ``C[i, j]`` (i ≠ j) is the number of tokens routed to both i and j; the diagonal
    is returned separately as ``n[i]``, the number of tokens routed to i, and zeroed in ``C``.

    Returns:
        ``(C [E, E] int64 with zero diagonal, n [E] int64)``.
    """
    num_experts = check_records(records)
    gram = torch.zeros(num_experts, num_experts, dtype=torch.float64)
    for r in records:
        A = selection_matrix(r)
        gram += A.T @ A
    return split_gram(gram)


def split_gram(gram: Tensor) -> tuple[Tensor, Tensor]:
    """``(C, n)`` of a selection Gram matrix ``Σ AᵀA``: off-diagonal co-selection counts
    (int64, zero diagonal) and the diagonal ``n`` (int64 tokens per expert)."""
    C = gram.clone()
    n = C.diagonal().clone()
    C.fill_diagonal_(0.0)
    return C.round().long(), n.round().long()


def coactivation_conditional(C: Tensor, n: Tensor) -> Tensor:
    """``[E, E]`` float64 ``P(j | i) = C[i, j] / n[i]``: of the tokens routed to i, the fraction
    also routed to j (row i is zero when ``n[i] = 0``)."""
    denom = n.double().clamp_min(1.0)[:, None]
    return torch.where(n[:, None] > 0, C.double() / denom, torch.zeros_like(C, dtype=torch.float64))
