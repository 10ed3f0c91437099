"""Soft-frequency pruning: keep the experts with the largest total combine weight.

Score = Σ over routed pairs of the combine weight g̃_e(x) (the router's top-k weight after its
renormalisation/scaling) [I: "sum of gate weights" read as the weights of routed pairs, not the
softmax mass of all tokens].
"""

from __future__ import annotations

from torch import Tensor

from moelab.compress.prune.criteria.base import ScoreCriterion
from moelab.compress.stats import LayerStats


class SoftFrequency(ScoreCriterion):
    """Score = Σ combine weights of the expert's routed pairs."""

    name = "soft-frequency"

    def scores(self, stats: LayerStats) -> tuple[Tensor, dict[str, Tensor]]:
        return stats.gate_sum.clone(), {}
