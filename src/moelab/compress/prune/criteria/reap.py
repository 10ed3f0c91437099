"""REAP: Router-weighted Expert Activation Pruning (Lasby et al., "REAP the Experts: Why
Pruning Prevails for One-Shot MoE Compression", Cerebras, arXiv 2510.13999; code
CerebrasResearch/reap).

Saliency ``S_e = mean over tokens routed to e of g̃_e(x) · ‖f_e(x)‖₂`` with the renormalised
top-k gate g̃ [C README]; prune the lowest, one shot per layer. An expert that received no
calibration token scores 0 [I].
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.compress.prune.criteria.base import ScoreCriterion
from moelab.compress.stats import LayerStats


class REAP(ScoreCriterion):
    """Score = Σ g̃·‖f_e(x)‖ / count (0 for an unused expert)."""

    name = "reap"

    def scores(self, stats: LayerStats) -> tuple[Tensor, dict[str, Tensor]]:
        n = stats.counts.double()
        score = torch.where(n > 0, stats.energy / n.clamp_min(1), torch.zeros_like(n))
        return score, {"count": n}
