"""Router confidence: routing entropy (nats and normalised by ln E) and the top-1/top-2 margin.

The per-token routing entropy ``H(p_t) = -Σ_e p_te ln p_te`` is the quantity of the router
entropy regulariser / diagnostics used e.g. in ST-MoE (Zoph et al., 2022, arXiv:2202.08906) and
is what :class:`~moelab.core.telemetry.RoutingRecord` stores as ``entropy``. Normalising by
``ln E`` maps it to ``[0, 1]`` (1 = uniform router). The top-1 margin ``p_(1) - p_(2)`` is the
classic classifier confidence margin (Scheffer et al., 2001), applied to the router distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis._common import check_records, ln, safe_div


@dataclass(frozen=True)
class ConfidenceStats:
    """Router confidence of one layer over its valid tokens.

    Attributes:
        entropy: mean per-token routing entropy in nats.
        normalized_entropy: ``entropy / ln E`` in ``[0, 1]`` (0 when E = 1).
        margin: mean ``p_top1 - p_top2`` in ``[0, 1]``.
        num_tokens: valid tokens averaged over.
    """

    entropy: float
    normalized_entropy: float
    margin: float
    num_tokens: int

    def to_dict(self) -> dict:
        return {
            "entropy": self.entropy,
            "normalized_entropy": self.normalized_entropy,
            "margin": self.margin,
            "num_tokens": self.num_tokens,
        }


def token_entropy(probs_TE: Tensor) -> Tensor:
    """``[T]`` float64 routing entropy in nats, ``-Σ_e p_te ln p_te`` (``0 ln 0 = 0``).

    Args:
        probs_TE: ``[T, E]`` per-token router distributions (rows sum to 1).
    """
    if probs_TE.dim() != 2:
        raise ValueError(f"probs_TE must be [T, E], got {tuple(probs_TE.shape)}")
    p = probs_TE.double()
    return -(torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))).sum(-1)


def token_margin(probs_TE: Tensor) -> Tensor:
    """``[T]`` float64 top-1 margin ``p_(1) - p_(2)`` of each row; with E = 1 it is ``p_(1)``."""
    if probs_TE.dim() != 2:
        raise ValueError(f"probs_TE must be [T, E], got {tuple(probs_TE.shape)}")
    p = probs_TE.double()
    if p.shape[1] == 1:
        return p[:, 0]
    top2 = p.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def confidence_sums(record) -> tuple[float, float, int]:
    """``(Σ_t H(p_t), Σ_t (p_t,(1) - p_t,(2)), n)`` over the valid tokens of one record."""
    mask = record.token_mask.bool().cpu()
    probs = record.probs.cpu()[mask]
    if probs.shape[0] == 0:
        return 0.0, 0.0, 0
    return float(token_entropy(probs).sum()), float(token_margin(probs).sum()), probs.shape[0]


def confidence_from_sums(
    entropy_sum: float, margin_sum: float, num_tokens: int, num_experts: int
) -> ConfidenceStats:
    """:class:`ConfidenceStats` from the sums of :func:`confidence_sums` (zeros when n = 0)."""
    entropy = safe_div(entropy_sum, num_tokens)
    return ConfidenceStats(
        entropy=entropy,
        normalized_entropy=safe_div(entropy, ln(num_experts)),
        margin=safe_div(margin_sum, num_tokens),
        num_tokens=num_tokens,
    )


def confidence_stats(records: Sequence) -> ConfidenceStats:
    """Router confidence of one layer from its records (means over all valid tokens of all records).

    ``entropy = mean_t H(p_t)`` in nats; ``normalized_entropy = entropy / ln E``;
    ``margin = mean_t (p_t,(1) - p_t,(2))``, where ``p_t,(k)`` is the k-th largest probability of
    token t. Tokens are weighted equally across records (not records equally). No valid token
    gives zeros.
    """
    num_experts = check_records(records)
    sums = [confidence_sums(r) for r in records]
    return confidence_from_sums(
        sum(s[0] for s in sums), sum(s[1] for s in sums), sum(s[2] for s in sums), num_experts
    )
