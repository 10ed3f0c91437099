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


def init_distributed(device: torch.device | None = None) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1): NCCL when
    this rank trains on a GPU (made the rank's current device), gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
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
