"""Independent benchmark jobs (whole training runs) over worker processes.

Small CPU models scale badly with torch threads: on 2 cores two 1-thread runs side by side
finish ~1.4-1.6x sooner than one 2-thread run after another. ``run_jobs`` keeps that choice in
one place: ``workers == 1`` runs in this process; more uses ``spawn`` processes (no forked
OpenMP state), each set to ``threads`` torch threads before its first job.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _init(threads: int) -> None:
    torch.set_num_threads(threads)


def run_jobs(
    jobs: Sequence[tuple[Callable[..., T], tuple[Any, ...]]], workers: int, threads: int
) -> list[T]:
    """``[fn(*args) for fn, args in jobs]``, in order, over ``workers`` processes.

    Each ``fn`` and its arguments must be picklable (module-level functions of the script).
    Jobs start in the order given, so put the longest first. A job's exception is raised here
    with its traceback once the jobs before it have finished; Ctrl-C, SIGTERM or such an
    exception stops the workers still running.
    """
    if workers < 1 or threads < 1:
        raise SystemExit(f"--workers and --threads must be >= 1, got {workers} and {threads}")
    if workers == 1:
        _init(threads)
        return [fn(*args) for fn, args in jobs]
    ctx = mp.get_context("spawn")
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(threads,))
    # a SIGTERM to this process alone would otherwise leave the workers training on
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        futures = [ex.submit(fn, *args) for fn, args in jobs]
        return [f.result() for f in futures]
    except BaseException:  # Ctrl-C, SIGTERM or a failed job: stop the other runs too
        ex.shutdown(wait=False, cancel_futures=True)
        for child in mp.active_children():
            child.terminate()
        raise
    finally:
        ex.shutdown()
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def merge_seed_runs(
    jobs: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]],
    outs: Sequence[tuple[dict, dict]],
    arms: Sequence[str],
    seeds: Sequence[int],
) -> tuple[dict, dict]:
    """Join jobs that each ran some arms for one seed (the seed is a job's last argument;
    its output ``(result.metrics, result.extra["run_seconds"])`` of ``run_seeds``) into
    ``metrics[arm][seed]`` and ``seconds[arm][str(seed)]``, seeds in the order given."""
    metrics: dict = {arm: {} for arm in arms}
    seconds: dict = {arm: {} for arm in arms}
    for (_, args), (met, sec) in zip(jobs, outs, strict=True):
        for arm in met:
            metrics[arm][args[-1]] = met[arm][args[-1]]
            seconds[arm].update(sec[arm])
    return {arm: {s: metrics[arm][s] for s in seeds} for arm in arms}, seconds
