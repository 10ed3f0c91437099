"""Expert load statistics: token fractions, coefficient of variation, max/mean, drops, dead experts.

Definitions follow the load-balancing literature: the per-expert fraction of routed pairs is the
``f_i`` of the Switch Transformer load-balancing loss (Fedus et al., 2022, "Switch Transformers",
JMLR, arXiv:2101.03961, eq. 4); the coefficient of variation of expert load is the
"importance/load CV" of Shazeer et al., 2017 ("Outrageously Large Neural Networks",
arXiv:1701.06538, eq. 6-10); max/mean is the "MaxVio + 1" load-imbalance measure of
Wang et al., 2024 ("Auxiliary-Loss-Free Load Balancing", arXiv:2408.15664).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis._common import check_records, safe_div, to_list
from moelab.core.telemetry import RoutingRecord


@dataclass(frozen=True)
class LoadStats:
    """Expert load of one layer, aggregated over its records.

    Attributes:
        counts: ``[E]`` int64 routed (token, expert) pairs per expert (valid tokens only).
        fraction: ``[E]`` float64 ``counts / counts.sum()`` (all zeros when nothing was routed).
        cv: coefficient of variation ``std(counts) / mean(counts)`` with the population std.
        max_over_mean: ``max(counts) / mean(counts)``; 1.0 is perfectly balanced.
        dropped: pairs dropped by capacity, summed over records.
        dead_experts: indices of experts that received no pair.
        total_pairs: ``counts.sum()``.
    """

    counts: Tensor
    fraction: Tensor
    cv: float
    max_over_mean: float
    dropped: int
    dead_experts: list[int]
    total_pairs: int

    def to_dict(self) -> dict:
        return {
            "counts": to_list(self.counts),
            "fraction": to_list(self.fraction),
            "cv": self.cv,
            "max_over_mean": self.max_over_mean,
            "dropped": self.dropped,
            "dead_experts": list(self.dead_experts),
            "num_dead": len(self.dead_experts),
            "total_pairs": self.total_pairs,
        }


def aggregate_counts(records: Sequence[RoutingRecord]) -> Tensor:
    """``[E]`` int64 sum of ``record.counts`` over the records of one layer (several batches)."""
    check_records(records)
    return torch.stack([r.counts.long().cpu() for r in records]).sum(0)


def load_stats_from_counts(counts: Tensor, dropped: int = 0) -> LoadStats:
    """Load statistics of one ``[E]`` count vector.

    ``fraction_i = c_i / Σ_j c_j``; ``cv = σ(c) / μ(c)`` with the population standard deviation
    ``σ = sqrt(mean((c - μ)²))``; ``max_over_mean = max(c) / μ(c)``; dead experts are those
    with ``c_i = 0``. When no pair was routed (``Σ c = 0``) fraction, cv and max_over_mean are 0
    (the convention of ``RoutingRecord.load_imbalance``) and every expert is dead.

    Raises:
        ValueError: when ``counts`` is not 1-D, is empty, or has a negative entry.
    """
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D [E] tensor, got {tuple(counts.shape)}")
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    c = counts.double()
    total = float(c.sum())
    mean = float(c.mean())
    std = float(c.std(unbiased=False))
    fraction = c / total if total > 0 else torch.zeros_like(c)
    return LoadStats(
        counts=counts.long(),
        fraction=fraction,
        cv=safe_div(std, mean),
        max_over_mean=safe_div(float(c.max()), mean),
        dropped=int(dropped),
        dead_experts=[int(i) for i in torch.nonzero(counts == 0).flatten()],
        total_pairs=int(total),
    )


def load_stats(records: Sequence[RoutingRecord]) -> LoadStats:
    """Load statistics of one layer from its records (counts summed over records, drops summed).

    See :func:`load_stats_from_counts` for the formulas. ``records`` is the list of
    :class:`RoutingRecord` one layer produced over several batches.
    """
    counts = aggregate_counts(records)
    return load_stats_from_counts(counts, dropped=sum(int(r.dropped) for r in records))


def load_stats_per_layer(records_by_layer: Sequence[Sequence[RoutingRecord]]) -> list[LoadStats]:
    """:func:`load_stats` of every layer; ``records_by_layer[l]`` lists layer ``l``'s records."""
    return [load_stats(recs) for recs in records_by_layer]
