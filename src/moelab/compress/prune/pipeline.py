"""Prune a model's experts end to end: calibrate, budget, select, remove.

:func:`prune_experts` runs

1. one calibration pass over the unpruned model collecting every MoE layer's streaming
   statistics (:class:`~moelab.compress.stats.LayerStats`): the effective rank of each layer's
   representations (RaGEP Stage 1 uses the MoE block *output*, as the authors' Mixtral script;
   ``rank_source="input"`` is their Qwen3 script's choice) and the counts/weights/energies the
   one-shot criteria need;
2. the per-layer budgets, uniform or rank-aware (:mod:`moelab.compress.prune.budget`);
3. the selection: one-shot criteria score every layer from the unpruned model (score criteria
   reuse pass 1; NAEE makes one more pass with its subset accumulators); sequential ones
   (RaGEP's Stage 2) score each layer on the model whose earlier layers are already pruned,
   carrying the calibration states up that model once (about two passes in all); a layer
   whose budget keeps all its experts is left as is;
4. the removal (:func:`moelab.compress.prune.apply.apply_pruning`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from moelab.compress.calibration import route
from moelab.compress.prune.apply import apply_pruning, check_prunable
from moelab.compress.prune.budget import (
    effective_rank,
    floors,
    rank_budget,
    total_budget,
    uniform_budget,
)
from moelab.compress.prune.criteria import Criterion, ScoreCriterion, Selection
from moelab.compress.stats import LayerStats, collect_stats
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import MoETransformer
from moelab.models.hooks import moe_layers, observe_moe_layers

PER_LAYER = ("uniform", "rank", "shuffled-rank")
"""Budget rules: equal shares, RaGEP's effective-rank budgets, and the control for them: the
same rank-derived scores given to other layers (a seeded permutation), so budgets are as
uneven as RaGEP's but not tied to each layer's own rank."""


class Progress(Protocol):
    def start_pass(self, label: str, total_tokens: int | None) -> None: ...
    def __call__(self, n_tokens: int) -> None: ...


@dataclass
class LayerReport:
    """One MoE layer of a pruning run."""

    layer: int
    experts: int
    kept: int
    keep: list[int]
    effective_rank: float
    scores: list[float] | None = None
    details: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class PruneResult:
    """The pruned model and what was done (``to_dict`` is ``prune.json``)."""

    model: MoETransformer
    method: str
    per_layer: str
    budget: int
    total_experts: int
    layers: list[LayerReport]
    options: dict[str, Any]
    calibration_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "per_layer": self.per_layer,
            "budget": self.budget,
            "total_experts": self.total_experts,
            "kept_fraction": self.budget / self.total_experts,
            "calibration_tokens": self.calibration_tokens,
            "options": self.options,
            "layers": [vars(r) for r in self.layers],
        }


def check_model(model: MoETransformer) -> None:
    """Raise ValueError unless every MoE layer can lose experts (and there is one)."""
    if not isinstance(model, MoETransformer):
        raise InvalidTypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    blocks = [b for b in model.blocks if b.is_moe]
    if not blocks:
        raise InvalidValueError("model: a dense model has no experts to prune")
    for b in blocks:
        check_prunable(b.ffn, f"layer {b.layer_idx}")


def calibrate(
    model: MoETransformer, batches: Iterable[Tensor], progress: Progress | None = None
) -> list[LayerStats]:
    """Pass 1: streaming statistics of every MoE layer of the unpruned model."""
    batches = list(batches)
    if progress is not None:
        progress.start_pass("calibrating", sum(b.numel() for b in batches))
    return collect_stats(model, batches, on_batch=progress)  # type: ignore[return-value]


def check_budget(
    model: MoETransformer, keep: float | int, per_layer: str, min_experts: int = 1
) -> int:
    """Validate the budget arguments before any calibration work; returns the total B.

    Raises:
        ValueError: unknown ``per_layer``; ``keep`` ≤ 0 or ≥ all experts; a budget below
            ``max(min_experts, top_k)`` in some layer (uniform: naming the layer).
    """
    if per_layer not in PER_LAYER:
        raise InvalidValueError(f"per_layer: must be one of {PER_LAYER}, got {per_layer!r}")
    layers = moe_layers(model)
    E = [m.experts.num_experts for m in layers]
    low = floors([m.config.router.top_k for m in layers], min_experts)
    B = total_budget(keep, E)
    if per_layer == "uniform":
        uniform_budget(B, E, low)
    else:
        rank_budget(B, E, low, [1.0] * len(E))
    return B


def shuffled(ranks: Sequence[float], seed: int) -> list[float]:
    """``ranks`` in a seeded order that moves every value when the values allow it (a
    permutation with no fixed point, from ``random.Random(f"shuffled-rank:{seed}")``; one layer
    keeps its own)."""
    n = len(ranks)
    if n < 2:
        return list(ranks)
    rng = random.Random(f"shuffled-rank:{seed}")
    while True:
        order = list(range(n))
        rng.shuffle(order)
        if all(order[i] != i for i in range(n)):
            return [ranks[i] for i in order]


def layer_budgets(
    model: MoETransformer,
    stats: Sequence[LayerStats],
    keep: float | int,
    per_layer: str,
    *,
    min_experts: int = 1,
    alpha: float = 1.0,
    rank_source: str = "output",
    seed: int = 0,
) -> tuple[int, list[int], list[float]]:
    """``(B, [n_l], [effective rank r_l])`` for the chosen rule, from pass-1 statistics
    (``"shuffled-rank"``: the budgets of the ranks permuted by :func:`shuffled` with ``seed``;
    the returned ranks are the layers' own).

    Raises:
        ValueError: as :func:`check_budget`, or a bad ``rank_source``.
    """
    B = check_budget(model, keep, per_layer, min_experts)
    layers = moe_layers(model)
    E = [m.experts.num_experts for m in layers]
    low = floors([m.config.router.top_k for m in layers], min_experts)
    ranks = [effective_rank(s.covariance(rank_source)) for s in stats]
    if per_layer == "uniform":
        return B, uniform_budget(B, E, low), ranks
    scores = shuffled(ranks, seed) if per_layer == "shuffled-rank" else ranks
    return B, rank_budget(B, E, low, scores, alpha), ranks


def _fill(
    model: MoETransformer,
    batches: list[Tensor],
    accs: dict[int, Any],
    progress: Progress | None,
    label: str,
) -> None:
    def observe(i, layer, x, out) -> None:
        if i in accs:
            accs[i].update(layer, x, out)

    if progress is not None:
        progress.start_pass(label, sum(b.numel() for b in batches))
    route(model, batches, observe, upto_layer=max(accs), on_batch=progress)


def _prune_sequential(
    model: MoETransformer,
    batches: list[Tensor],
    criterion: Criterion,
    budgets: list[int],
    todo: list[int],
    progress: Progress | None,
) -> tuple[MoETransformer, dict[int, Selection]]:
    """Select and prune the ``todo`` layers in depth order, each from the calibration states
    of the model whose earlier layers are already pruned (RaGEP's Stage 2).

    The states entering the next layer's block are carried up the pruned copy once
    (:meth:`~moelab.models.MoETransformer.advance`), so the cost is about two forward passes
    however many layers are pruned, where re-running the set from the embeddings for each
    layer costs about half a pass per layer; the statistics are the same bit for bit. The
    states take ``tokens × d_model`` values of the model dtype.
    """
    work = copy.deepcopy(model)
    was_training = work.training
    work.eval()
    device = next(work.parameters()).device
    n_layers = len(moe_layers(work))
    moe_blocks = [b.layer_idx for b in work.blocks if b.is_moe]
    selections: dict[int, Selection] = {}
    with torch.no_grad():
        hidden = [work.hidden_at(ids.to(device), block=0) for ids in batches]
        at = 0
        for j in todo:
            block = moe_blocks[j]
            hidden = [work.advance(h, start_block=at, stop_block=block) for h in hidden]
            at = block
            acc = criterion.accumulator(moe_layers(work)[j], budgets[j])

            def observe(i, layer, x, out, j=j, acc=acc) -> None:
                if i == j:
                    acc.update(layer, x, out)

            if progress is not None:
                label = f"{criterion.name}: layer {j + 1}/{n_layers}"
                progress.start_pass(label, sum(b.numel() for b in batches))
            with observe_moe_layers(work, observe):
                for h, ids in zip(hidden, batches, strict=True):
                    work.advance(h, start_block=block, stop_block=block + 1)
                    if progress is not None:
                        progress(ids.numel())
            selections[j] = criterion.select(acc, budgets[j])
            keeps = [selections[j].keep if i == j else None for i in range(n_layers)]
            work = apply_pruning(work, keeps, inplace=True)
    work.train(was_training)
    return work, selections


def prune_experts(
    model: MoETransformer,
    batches: Iterable[Tensor],
    criterion: Criterion,
    keep: float | int,
    *,
    per_layer: str = "rank",
    min_experts: int = 1,
    alpha: float = 1.0,
    rank_source: str = "output",
    stats: Sequence[LayerStats] | None = None,
    progress: Progress | None = None,
    seed: int = 0,
) -> PruneResult:
    """Prune ``model``'s routed experts to a global budget (the input model is not modified).

    Args:
        model: a model with token-choice MoE layers (no group-limited routing).
        batches: calibration ``[B, S]`` int64 ids (e.g. a
            :class:`~moelab.compress.calibration.CalibrationSet`); iterated once per pass.
        criterion: which experts to keep (:func:`~moelab.compress.prune.criteria.build_criterion`).
        keep: float fraction in (0, 1) of all routed experts, or an int total.
        per_layer: ``"uniform"`` (equal shares), ``"rank"`` (RaGEP Stage 1) or
            ``"shuffled-rank"`` (the control: rank budgets given to other layers).
        min_experts: floor per layer besides top_k (the authors: 2 Mixtral, 1 DeepSeek, 4 Qwen3).
        alpha: exponent of the effective rank in the layer score.
        rank_source: ``"output"`` (Mixtral script) or ``"input"`` (Qwen3 script) of each MoE
            layer for the effective rank.
        stats: pass-1 statistics already collected with :func:`calibrate` on these batches
            (benchmarks reuse them across criteria); None collects them.
        progress: a :class:`~moelab.compress.progress.TokenProgress` (or None).
        seed: the ``"shuffled-rank"`` permutation's seed.
    Returns:
        :class:`PruneResult` with the pruned model (same dtype/device).
    Raises:
        ValueError / TypeError: a dense model, an unprunable layer or one the criterion
            cannot score (:meth:`Criterion.check_layer`), a bad ``keep`` (≤ 0, ≥ all, below
            top_k per layer), unknown ``per_layer`` — all before any calibration pass.
    """
    check_model(model)
    batches = list(batches)
    if not batches:
        raise InvalidValueError("batches: no calibration batch")
    layers = moe_layers(model)
    for b, layer in zip((b for b in model.blocks if b.is_moe), layers, strict=True):
        criterion.check_layer(layer, f"layer {b.layer_idx}")  # before any calibration pass
    if rank_source not in ("input", "output"):
        raise InvalidValueError(f"rank_source: must be 'input' or 'output', got {rank_source!r}")
    check_budget(model, keep, per_layer, min_experts)
    if stats is None:
        stats = calibrate(model, batches, progress)
    B, budgets, ranks = layer_budgets(
        model, stats, keep, per_layer, min_experts=min_experts, alpha=alpha,
        rank_source=rank_source, seed=seed,
    )  # fmt: skip
    E = [m.experts.num_experts for m in layers]
    todo = [j for j in range(len(layers)) if budgets[j] < E[j]]
    selections: dict[int, Selection] = {}
    if criterion.sequential:
        pruned, selections = _prune_sequential(model, batches, criterion, budgets, todo, progress)
    else:
        if isinstance(criterion, ScoreCriterion) and not criterion.directions:
            accs: dict[int, Any] = {j: stats[j] for j in todo}
        else:
            accs = {j: criterion.accumulator(layers[j], budgets[j]) for j in todo}
            if accs:
                _fill(model, batches, accs, progress, f"{criterion.name}: scoring")
        selections = {j: criterion.select(accs[j], budgets[j]) for j in todo}
        pruned = apply_pruning(model, [selections[j].keep if j in selections else None
                                       for j in range(len(layers))])  # fmt: skip
    blocks = [b for b in model.blocks if b.is_moe]
    reports = []
    for j, block in enumerate(blocks):
        sel = selections.get(j, Selection(keep=list(range(E[j]))))
        reports.append(
            LayerReport(
                layer=block.layer_idx,
                experts=E[j],
                kept=len(sel.keep),
                keep=sel.keep,
                effective_rank=ranks[j],
                scores=sel.scores,
                details=sel.details,
            )
        )
    return PruneResult(
        model=pruned,
        method=criterion.name,
        per_layer=per_layer,
        budget=B,
        total_experts=sum(E),
        layers=reports,
        options={
            **criterion.options(),
            "min_experts": min_experts,
            "alpha": alpha,
            "rank_source": rank_source,
        },
        calibration_tokens=sum(b.numel() for b in batches),
    )
