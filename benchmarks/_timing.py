"""Noise-robust wall-clock timing for the benchmarks: warm-up, calibrated inner loops,
candidates interleaved round-robin (so a burst of background load hits all of them alike),
median of the repeats, and a per-candidate time budget so one slow candidate cannot
dominate the run."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable


def _time_once(fn: Callable[[], object], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, **options: float
) -> dict[str, float]:
    """Median seconds per call of every function (:func:`interleaved_samples`, whose keyword
    ``options`` it takes)."""
    samples = interleaved_samples(fns, repeats, **options)
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    min_sample_s: float = 0.05,
    budget_s: float = 5.0,
    min_repeats: int = 3,
) -> dict[str, list[float]]:
    """Seconds per call of every function, one value per sample in sample order (sample r
    of every function taken in the same round).

    Each function is warmed up (``warmup`` calls, fewer when one call takes over 0.5 s) and
    its inner loop calibrated so a timed sample lasts at least ``min_sample_s``; it then gets
    ``repeats`` samples, cut to ``budget_s`` of timed work but never below ``min_repeats``
    (a single sample when one call alone exceeds the budget).
    Samples are taken round-robin over the functions with the garbage collector paused.
    """
    inner: dict[str, int] = {}
    n_samples: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            if _time_once(fn, 1) > 0.5:
                break
        one = _time_once(fn, 1)  # calibration call, also the last warm-up
        inner[name] = max(1, math.ceil(min_sample_s / max(one, 1e-9)))
        sample = one * inner[name]
        floor = 1 if sample > budget_s else min(repeats, min_repeats)  # very slow: one sample
        n_samples[name] = max(floor, min(repeats, int(budget_s / sample)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(max(n_samples.values(), default=0)):
            for name, fn in fns.items():
                if r < n_samples[name]:
                    samples[name].append(_time_once(fn, inner[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples
