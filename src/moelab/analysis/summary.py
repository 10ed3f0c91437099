"""``analyze``: every routing metric of a run as one JSON-serialisable dict, and ``write_json``."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from moelab.analysis._common import check_records, to_list
from moelab.analysis.coactivation import coactivation_conditional
from moelab.analysis.rank import effective_rank
from moelab.analysis.redundancy import expert_redundancy
from moelab.analysis.specialisation import split_domains
from moelab.analysis.stream import RoutingAccumulator
from moelab.core.telemetry import RoutingRecord
from moelab.utils.atomic import atomic_write_text

FORMAT = "moelab.analysis"
FORMAT_VERSION = 1

#: Per-layer headline numbers, in the order the report's summary table shows them.
HEADLINE_KEYS = (
    "layer",
    "num_experts",
    "cv",
    "max_over_mean",
    "num_dead",
    "dropped",
    "entropy",
    "normalized_entropy",
    "margin",
    "adjacent_consistency",
    "pathway_nmi_next",
    "domain_nmi",
    "effective_rank",
    "redundancy",
)


def _check_per_layer(name: str, value: Sequence | None, num_layers: int) -> None:
    if value is not None and len(value) != num_layers:
        raise ValueError(f"{name} has {len(value)} entries but records_by_layer has {num_layers}")


def analyze(
    records_by_layer: list[list[RoutingRecord]],
    domains: Tensor | None = None,
    domain_names: list[str] | None = None,
    hidden_by_layer: list[Tensor] | None = None,
    expert_outputs_by_layer: list[Tensor] | None = None,
) -> dict:
    """Every routing metric of a model, per layer, as a JSON-serialisable dict.

    Feeds the records batch by batch into a :class:`~moelab.analysis.stream.RoutingAccumulator`
    and returns :func:`summarize` of it; to analyse more tokens than fit in memory, feed the
    accumulator directly (as :func:`moelab.analysis.collect.collect` does).

    Args:
        records_by_layer: ``records_by_layer[l]`` is the list of :class:`RoutingRecord` that
            layer ``l`` produced, one per batch; batch ``b`` must be the same tokens in every
            layer (needed for the cross-layer transitions).
        domains: optional per-token int64 domain labels of all batches concatenated in record
            order (``[Σ_b T_b]``), or a list of ``[T_b]`` tensors; shared by all layers.
        domain_names: optional names of the domains (label d is ``domain_names[d]``); fixes
            the number of domains.
        hidden_by_layer: optional ``[T, D]`` representation per layer (e.g. the layer's input
            or output hidden states) for the effective rank; an entry may be None.
        expert_outputs_by_layer: optional ``[E, T, D]`` outputs of every expert of layer ``l``
            on the same tokens, for expert redundancy; an entry may be None.

    Returns:
        See :func:`summarize`.

    Raises:
        ValueError: for an empty ``records_by_layer``, mismatched list lengths, or
            ``domain_names`` without ``domains``.
    """
    if len(records_by_layer) == 0:
        raise ValueError("records_by_layer must hold at least one layer")
    for i, recs in enumerate(records_by_layer):
        check_records(recs, f"records_by_layer[{i}]")
        if len(recs) != len(records_by_layer[0]):
            raise ValueError(
                f"records_by_layer[{i}] holds {len(recs)} records but records_by_layer[0] "
                f"{len(records_by_layer[0])}; every layer must see the same batches"
            )
    if domain_names is not None and domains is None:
        raise ValueError("domain_names was given without domains")
    labels = None if domains is None else split_domains(domains, records_by_layer[0])
    acc = RoutingAccumulator(len(domain_names) if domain_names is not None else None)
    for b, batch in enumerate(zip(*records_by_layer, strict=True)):
        acc.update(batch, None if labels is None else labels[b])
    return summarize(acc, domain_names, hidden_by_layer, expert_outputs_by_layer)


def summarize(
    acc: RoutingAccumulator,
    domain_names: list[str] | None = None,
    hidden_by_layer: list[Tensor] | None = None,
    expert_outputs_by_layer: list[Tensor] | None = None,
) -> dict:
    """The analysis dict of streamed routing statistics (see :func:`analyze` for the inputs).

    Returns:
        ``{"format", "version", "num_layers", "num_experts": [E_l], "domain_names",
        "layers": [per-layer dict], "transitions": [L-1 dicts], "headline": [per-layer row]}``.
        Each per-layer dict holds ``load`` (:class:`~moelab.analysis.load.LoadStats`),
        ``confidence``, ``coactivation`` (``counts``, ``tokens_per_expert``, ``conditional``),
        ``adjacent_consistency``, and when the batches carried domain labels ``domains``, when
        given ``effective_rank``, ``redundancy``. Matrices are nested lists; no NaN or
        infinity appears.

    Raises:
        ValueError: when the accumulator saw no batch, or a per-layer list has the wrong length.
    """
    if acc.num_batches == 0:
        raise ValueError("the routing accumulator saw no batch; nothing to analyse")
    num_layers = len(acc.layers)
    num_experts = [lay.num_experts for lay in acc.layers]
    _check_per_layer("hidden_by_layer", hidden_by_layer, num_layers)
    _check_per_layer("expert_outputs_by_layer", expert_outputs_by_layer, num_layers)
    trans = acc.transitions()
    layers: list[dict[str, Any]] = []
    headline: list[dict[str, Any]] = []
    for i, lay in enumerate(acc.layers):
        load = lay.load()
        conf = lay.confidence()
        C, n = lay.coactivation()
        adj = lay.adjacent()
        entry: dict[str, Any] = {
            "layer": i,
            "num_experts": num_experts[i],
            "num_records": lay.num_records,
            "load": load.to_dict(),
            "confidence": conf.to_dict(),
            "coactivation": {
                "counts": to_list(C),
                "tokens_per_expert": to_list(n),
                "conditional": to_list(coactivation_conditional(C, n)),
            },
            "adjacent_consistency": adj.to_dict(),
        }
        row: dict[str, Any] = {
            "layer": i,
            "num_experts": num_experts[i],
            "cv": load.cv,
            "max_over_mean": load.max_over_mean,
            "num_dead": len(load.dead_experts),
            "dropped": load.dropped,
            "entropy": conf.entropy,
            "normalized_entropy": conf.normalized_entropy,
            "margin": conf.margin,
            "adjacent_consistency": adj.fraction,
            "pathway_nmi_next": trans[i].nmi if i < len(trans) else None,
            "domain_nmi": None,
            "effective_rank": None,
            "redundancy": None,
        }
        ds = lay.domains()
        if ds is not None:
            entry["domains"] = ds.to_dict()
            row["domain_nmi"] = ds.nmi
        if hidden_by_layer is not None and hidden_by_layer[i] is not None:
            er = effective_rank(hidden_by_layer[i])
            entry["effective_rank"] = er
            row["effective_rank"] = er
        if expert_outputs_by_layer is not None and expert_outputs_by_layer[i] is not None:
            red = expert_redundancy(expert_outputs_by_layer[i])
            entry["redundancy"] = red.to_dict()
            row["redundancy"] = red.mean_pairwise
        layers.append(entry)
        headline.append(row)

    if "domains" in layers[0] and domain_names is None:
        n_dom = len(layers[0]["domains"]["counts"])
        domain_names = [f"domain {d}" for d in range(n_dom)]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "num_layers": num_layers,
        "num_experts": num_experts,
        "domain_names": list(domain_names) if "domains" in layers[0] else None,
        "layers": layers,
        "transitions": [t.to_dict() for t in trans],
        "headline": headline,
    }


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return to_list(obj)
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`atomic_write_bytes`).

    Tensors and numpy arrays are written as nested lists.

    Raises:
        ValueError: when ``obj`` holds NaN or infinity (not valid JSON).
        TypeError: when ``obj`` holds a value JSON cannot represent.
    """
    text = json.dumps(obj, indent=2, allow_nan=False, default=_json_default)
    return atomic_write_text(path, text + "\n")
