"""Expert pruning: RaGEP (rank-aware budgets + Spectral-Salience) and its baselines
(frequency, soft frequency, REAP, NAEE enumeration), and the removal of experts from a model."""

from moelab.compress.prune.apply import apply_pruning, check_prunable, prune_layer, pruned_config
from moelab.compress.prune.budget import (
    effective_rank,
    floors,
    rank_budget,
    total_budget,
    uniform_budget,
)
from moelab.compress.prune.criteria import CRITERIA, Criterion, Selection, build_criterion
from moelab.compress.prune.pipeline import (
    PER_LAYER,
    LayerReport,
    PruneResult,
    calibrate,
    check_budget,
    check_model,
    layer_budgets,
    prune_experts,
)

__all__ = [
    "CRITERIA",
    "PER_LAYER",
    "Criterion",
    "LayerReport",
    "PruneResult",
    "Selection",
    "apply_pruning",
    "build_criterion",
    "calibrate",
    "check_budget",
    "check_model",
    "check_prunable",
    "effective_rank",
    "floors",
    "layer_budgets",
    "prune_experts",
    "prune_layer",
    "pruned_config",
    "rank_budget",
    "total_budget",
    "uniform_budget",
]
