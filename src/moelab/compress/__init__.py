"""Compression of trained MoE models: calibration, expert pruning (RaGEP and baselines)."""

from moelab.compress.calibration import (
    CalibrationSet,
    RoutedPairs,
    RunData,
    calibration_documents,
    calibration_set,
    domain_streams,
    expert_outputs,
    held_out_documents,
    route,
    routed_pairs,
    run_data,
    training_documents,
)
from moelab.compress.stats import LayerStats, collect_stats

__all__ = [
    "CalibrationSet",
    "LayerStats",
    "RoutedPairs",
    "RunData",
    "calibration_documents",
    "calibration_set",
    "collect_stats",
    "domain_streams",
    "expert_outputs",
    "held_out_documents",
    "route",
    "routed_pairs",
    "run_data",
    "training_documents",
]
