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
from pathlib import Path
from typing import Any, TypeVar

import torch

from moelab.utils.jsonfile import read_json

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


def part_file(parts: Path, arms: str | Sequence[str], seed: int) -> Path:
    """Where one job (an arm or a group of arms, one seed) keeps its output in ``parts``."""
    name = arms if isinstance(arms, str) else "-".join(arms)
    return parts / f"{name}_seed{seed}.json"


def run_or_merge(
    jobs: Sequence[tuple[Callable[..., Any], tuple]],
    parts: Path,
    seeds: Sequence[int],
    *,
    merge: bool,
    workers: int,
    threads: int,
) -> tuple[list[int], list, list]:
    """``(seeds, jobs, outputs)`` of seed-by-arm jobs ``(fn, (arms, _, seed, ...))`` that each
    write :func:`part_file` ``(parts, arms, seed)`` when they finish: run them all, or with
    ``merge`` read back the parts of the seeds whose every job finished (a run cut short).

    Raises:
        SystemExit: ``merge`` and no seed has all its parts.
    """
    if not merge:
        return list(seeds), list(jobs), run_jobs(jobs, workers, threads)
    done = [
        s
        for s in seeds
        if all(part_file(parts, a[0], a[2]).is_file() for _, a in jobs if a[2] == s)
    ]
    if not done:
        raise SystemExit(f"--merge: no seed has every part in {parts}")
    kept = [j for j in jobs if j[1][2] in done]
    return done, kept, [read_json(part_file(parts, a[0], a[2])) for _, a in kept]
