"""Data-parallel setup for ``torchrun`` (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the data-parallel group (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group. A DDP reducer caught in a reference cycle (a traceback's
    frames, a module's hooks) still holds the group; collecting it first lets gloo's worker
    threads stop now, while the interpreter is whole, rather than during its finalization."""
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
