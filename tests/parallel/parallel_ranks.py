"""Run a function on W gloo ranks (one thread each) and collect what each rank returns.

Worker functions live in top-level modules of this folder (``parallel_workers``; conftest.py
puts the folder on sys.path) because the spawned processes must import them by name.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out: str, kwargs: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():  # moelab.train.loop.train shuts the group down itself
            dist.destroy_process_group()


def run_ranks(fn, world: int, timeout: float = 120.0, **kwargs) -> list:
    """``fn(rank, world, **kwargs)`` on ``world`` processes; returns the ranks' results."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(_entry, args=(world, free_port(), fn, out, kwargs), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish in {timeout} s")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
