"""The runner every recipe shares: run seeds × arms, collect metrics, make the result.

A recipe is any object with a ``name`` and ``run(config, seed) -> {metric: value}``
(:class:`Recipe`); its config is a dataclass. :func:`run_seeds` runs it once per seed and arm,
where an arm is the base config with some fields replaced (the method and its baselines or
ablations as config variants of one recipe), and returns the shared
:class:`~moelab.utils.results.BenchmarkResult` (written to ``out`` if given). A recipe's CLI
command and its benchmark both call it, so they cannot drift apart.

Pairing: for one seed every arm gets the same ``seed`` argument and the same global RNG state
(``random``, ``numpy`` and ``torch`` are seeded with it before each run), so a recipe that
derives its data split, class order and initial weights from the seed gives paired runs, and
the result's paired differences and t-intervals are meaningful.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.utils.results import BenchmarkResult, check_metrics, make_result, write_result

ConfigT = TypeVar("ConfigT", contravariant=True)


class Recipe(Protocol[ConfigT]):
    """What :func:`run_seeds` runs.

    Attributes:
        name: the method's name (``"care"``); the result's ``method``.
    """

    name: str

    def run(self, config: ConfigT, seed: int) -> Mapping[str, float]:
        """Train/evaluate once with ``config`` and ``seed``; finite metrics by name."""
        ...


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch's default generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _json_config(obj: Any, recipe: str) -> Any:
    def default(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise InvalidTypeError(
            f"recipe {recipe!r}: config value {value!r} ({type(value).__name__}) "
            "cannot be written to the result JSON"
        )

    try:
        text = json.dumps(obj, default=default, allow_nan=False)
    except ValueError as e:  # NaN or infinity in the config
        raise InvalidValueError(f"recipe {recipe!r}: config holds {e}") from None
    # the round trip turns tuples into lists, so the result equals its reloaded copy
    return json.loads(text)


def _arm_configs(
    recipe: str, config: Any, arms: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, Any]:
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise InvalidTypeError(
            f"recipe {recipe!r}: config must be a dataclass instance, got {type(config).__name__}"
        )
    if arms is None:
        return {recipe: config}
    if not isinstance(arms, Mapping) or not arms:
        raise InvalidValueError(f"arms must be a non-empty mapping arm -> overrides, got {arms!r}")
    fields = {f.name for f in dataclasses.fields(config)}
    out = {}
    for arm, overrides in arms.items():
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise InvalidValueError(
                f"arm {arm!r}: {type(config).__name__} has no field {unknown[0]!r} "
                f"(fields: {', '.join(sorted(fields))})"
            )
        out[arm] = dataclasses.replace(config, **overrides)
    return out


def run_seeds(
    recipe: Recipe[Any],
    config: Any,
    seeds: Sequence[int],
    *,
    arms: Mapping[str, Mapping[str, Any]] | None = None,
    pairs: Sequence[tuple[str, str]] | None = None,
    name: str | None = None,
    out: str | os.PathLike[str] | None = None,
    confidence: float = 0.95,
) -> BenchmarkResult:
    """Run ``recipe`` for every seed and arm and collect the shared result.

    Seeds are the outer loop (seed 0: every arm, then seed 1, ...); before each run the global
    RNGs are reset with :func:`seed_everything`.

    Args:
        recipe: object with ``name`` and ``run(config, seed)`` (:class:`Recipe`).
        config: the base config, a dataclass instance.
        seeds: distinct ints.
        arms: ``{arm: {field: value}}``, each arm the base config with those fields replaced
            (``dataclasses.replace``, so the config's own checks run); the first arm is the
            method. Default: one arm named ``recipe.name`` with ``config`` as is.
        pairs: ``(arm, baseline)`` pairs for paired differences; default the first arm against
            every other.
        name: the benchmark name (default ``recipe.name``).
        out: if given, the result is also written there atomically.
        confidence: level of the t-intervals.

    Returns:
        The result: ``config`` is ``{"recipe": name, "base": asdict(config), "arms": arms}``,
        ``extra["run_seconds"][arm][seed]`` the wall time of each run.

    Raises:
        InvalidTypeError: ``config`` is not a dataclass instance, or holds a value JSON cannot
            hold.
        InvalidValueError: a NaN or infinite config value; bad seeds or arms (an arm naming an unknown field), a run returning
            a non-finite or non-numeric metric (named ``metrics.<arm>.<seed>.<metric>``, raised
            right after that run), arms reporting different metrics across seeds.
    """
    seeds = list(seeds)
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise InvalidValueError(f"seeds must be a non-empty list of ints, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise InvalidValueError(f"seeds must be distinct, got {seeds!r}")
    configs = _arm_configs(recipe.name, config, arms)
    settings = _json_config(
        {
            "recipe": recipe.name,
            "base": dataclasses.asdict(config),
            "arms": {a: dict(o) for a, o in (arms or {}).items()},
        },
        recipe.name,
    )
    metrics: dict[str, dict[int, dict[str, float]]] = {arm: {} for arm in configs}
    seconds: dict[str, dict[str, float]] = {arm: {} for arm in configs}
    for seed in seeds:
        for arm, arm_config in configs.items():
            seed_everything(seed)
            start = time.perf_counter()
            values = recipe.run(arm_config, seed)
            seconds[arm][str(seed)] = time.perf_counter() - start
            check_metrics(values, f"metrics.{arm}.{seed}")
            metrics[arm][seed] = dict(values)
    result = make_result(
        name or recipe.name,
        recipe.name,
        settings,
        metrics,
        pairs=pairs,
        confidence=confidence,
        extra={"run_seconds": seconds},
    )
    if out is not None:
        write_result(result, Path(out))
    return result
