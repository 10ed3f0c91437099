"""Frequency pruning: keep the experts the router sends the most calibration tokens to (the
routed-pair count; the classic baseline, e.g. in NAEE's and REAP's comparisons)."""

from __future__ import annotations

from torch import Tensor

from moelab.compress.prune.criteria.base import ScoreCriterion
from moelab.compress.stats import LayerStats


class Frequency(ScoreCriterion):
    """Score = number of routed (token, expert) pairs of the expert."""

    name = "frequency"

    def scores(self, stats: LayerStats) -> tuple[Tensor, dict[str, Tensor]]:
        return stats.counts.double(), {}
