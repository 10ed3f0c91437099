"""Run a function on W local processes joined in one gloo process group (tests, benchmarks,
notebooks): the in-process counterpart of ``torchrun --nproc-per-node W``.

``fn`` must be importable by name in a fresh interpreter (a module-level function of an
importable module, or of the ``__main__`` script guarded by ``if __name__ == "__main__"``),
because the processes are spawned. Each rank runs ``fn(rank, world, **kwargs)`` with
``threads`` intra-op threads; what it returns is saved with ``torch.save`` and handed back.
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

from moelab.errors import InvalidValueError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out: str, threads: int, kwargs: dict) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():  # moelab.train.loop.train shuts the group down itself
            dist.destroy_process_group()


def spawn_ranks(fn, world: int, timeout: float = 300.0, threads: int = 1, **kwargs) -> list:
    """``fn(rank, world, **kwargs)`` on ``world`` gloo ranks; returns the ranks' results.

    Raises:
        ValueError: ``world`` < 1. TimeoutError: not done in ``timeout`` seconds (the
        processes are killed). ``torch.multiprocessing.ProcessRaisedException``: a rank failed.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidValueError(f"world: must be an int >= 1, got {world!r}")
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(
            _entry,
            args=(world, free_port(), fn, out, threads, kwargs),
            nprocs=world,
            join=False,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish in {timeout} s")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
