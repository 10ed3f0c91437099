"""Rank functions of the fault tests (imported by spawned processes): waits for rank 0 alone,
and collectives of expert-parallel subgroups, when a rank does not answer."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moelab.errors import DistributedTimeoutError
from moelab.parallel.comm import build_groups
from moelab.train.distributed import DistInfo
from moelab.train.main_rank import MainRankFailedError, MainRankWork


def _timed(fn) -> tuple[str, float]:
    """(what ``fn`` returned or raised, as text; its seconds)."""
    t0 = time.monotonic()
    try:
        out = repr(fn())
    except (DistributedTimeoutError, MainRankFailedError, ZeroDivisionError) as e:
        out = f"{type(e).__name__}: {e}"
    return out, time.monotonic() - t0


def main_rank_waits(rank, world, timeout_s):
    """Rank 0 works alone three times: 3 timeouts long, failing, and frozen (SIGSTOP); the
    other ranks wait each time, and rank 1 continues rank 0 when they give up on it."""
    work = MainRankWork(DistInfo(rank=rank, world_size=world, timeout_s=timeout_s))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def slow():
        time.sleep(3 * timeout_s)
        return "slow done"

    def frozen():
        os.kill(os.getpid(), signal.SIGSTOP)
        return "continued"

    out = {"slow": _timed(lambda: work.run(slow, "sleeping"))}
    out["failing"] = _timed(lambda: work.run(lambda: 1 / 0, "dividing"))
    out["frozen"] = _timed(lambda: work.run(frozen, "freezing"))
    if rank == 1:
        os.kill(pids[0], signal.SIGCONT)
    return out


def ep_subgroup_times_out(rank, world, timeout_s):
    """world 4, EP 2: ranks 2 and 3 form an EP group; rank 3 does not join rank 2's
    all-reduce (it stays alive, so rank 2 can only time out); ranks 0 and 1 sum normally."""
    groups = build_groups(2, timedelta(seconds=timeout_s))
    dist.barrier()
    if rank == 3:
        time.sleep(3 * timeout_s)
        return None
    x = torch.ones(1)
    t0 = time.monotonic()
    try:
        dist.all_reduce(x, group=groups.ep_group)
    except RuntimeError as e:
        return "timed out" in str(e).lower(), time.monotonic() - t0
    return x.item()
