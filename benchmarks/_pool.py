"""Independent benchmark jobs (whole training runs) over worker processes.

Small CPU models scale badly with torch threads: on 2 cores two 1-thread runs side by side
finish ~1.4-1.6x sooner than one 2-thread run after another. ``run_jobs`` keeps that choice in
one place: ``workers == 1`` runs in this process; more uses ``spawn`` processes (no forked
OpenMP state), each set to ``threads`` torch threads before its first job.
"""

from __future__ import annotations

import multiprocessing as mp
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
    with its traceback once the jobs before it have finished.
    """
    if workers < 1 or threads < 1:
        raise SystemExit(f"--workers and --threads must be >= 1, got {workers} and {threads}")
    if workers == 1:
        _init(threads)
        return [fn(*args) for fn, args in jobs]
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(threads,)) as ex:
        futures = [ex.submit(fn, *args) for fn, args in jobs]
        return [f.result() for f in futures]
