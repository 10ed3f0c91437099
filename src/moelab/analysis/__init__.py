"""Routing analysis of MoE models: metrics over RoutingRecords, plots and an HTML report.

Typical use::

    from moelab.analysis import analyze, write_json, plot_all, write_report

    result = analyze(records_by_layer, domains=labels, domain_names=["code", "prose"])
    write_json(result, run_dir / "analysis.json")
    pngs = plot_all(result, run_dir / "plots")
    write_report(result, pngs, run_dir / "report.html")

Plots and the report need matplotlib (the ``analysis`` extra); the metrics need only torch, and
importing this package does not import matplotlib until a plotting name is used.
"""

from __future__ import annotations

from typing import Any

from moelab.analysis._common import nmi_from_contingency
from moelab.analysis.coactivation import (
    coactivation_conditional,
    coactivation_counts,
    selection_matrix,
)
from moelab.analysis.confidence import (
    ConfidenceStats,
    confidence_stats,
    token_entropy,
    token_margin,
)
from moelab.analysis.consistency import (
    Agreement,
    adjacent_agreement_counts,
    adjacent_consistency,
    route_stability,
)
from moelab.analysis.load import (
    LoadStats,
    aggregate_counts,
    load_stats,
    load_stats_from_counts,
    load_stats_per_layer,
)
from moelab.analysis.pathways import (
    Transition,
    row_normalize,
    transition,
    transition_counts_from_labels,
    transitions,
)
from moelab.analysis.rank import effective_rank
from moelab.analysis.redundancy import Redundancy, expert_redundancy
from moelab.analysis.specialisation import (
    DomainStats,
    domain_expert_counts,
    domain_stats,
    split_domains,
)
from moelab.analysis.stream import LayerAccumulator, RoutingAccumulator
from moelab.analysis.summary import analyze, summarize, write_json

_LAZY = {"plot_all": "moelab.analysis.plots", "write_report": "moelab.analysis.report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moelab.analysis' has no attribute {name!r}")


__all__ = [
    "Agreement",
    "ConfidenceStats",
    "DomainStats",
    "LayerAccumulator",
    "LoadStats",
    "Redundancy",
    "RoutingAccumulator",
    "Transition",
    "adjacent_agreement_counts",
    "adjacent_consistency",
    "aggregate_counts",
    "analyze",
    "coactivation_conditional",
    "coactivation_counts",
    "confidence_stats",
    "domain_expert_counts",
    "domain_stats",
    "effective_rank",
    "expert_redundancy",
    "load_stats",
    "load_stats_from_counts",
    "load_stats_per_layer",
    "nmi_from_contingency",
    "plot_all",
    "route_stability",
    "row_normalize",
    "selection_matrix",
    "split_domains",
    "summarize",
    "token_entropy",
    "token_margin",
    "transition",
    "transition_counts_from_labels",
    "transitions",
    "write_json",
    "write_report",
]
