"""Data-parallel setup for ``torchrun`` (gloo on CPU, nccl on CUDA), with a timeout.

A collective waits for every rank of its group. torch's default limit is 30 minutes for gloo,
so a rank that was stopped (SIGSTOP, a debugger, a frozen node) or hung held its peers for
half an hour. moelab sets the limit itself: ``timeout_s`` (``moelab train --dist-timeout``,
default :data:`DEFAULT_DIST_TIMEOUT_S`) on the default group here and on the expert-parallel
subgroups (:func:`moelab.parallel.comm.build_groups`). When it runs out, gloo raises in the
waiting rank (reported as :class:`~moelab.errors.DistributedTimeoutError` by
:func:`timeout_error`); NCCL's watchdog ends the process itself
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default, 3).

Why 600 s: in a healthy run a collective waits only for the slowest rank's share of one
step; the long work rank 0 does alone (validation, checkpoints and the final model under data
parallelism) is waited for through :mod:`moelab.train.main_rank`, which does not count
against this limit (it waits as long as rank 0 is alive); what remains are short writes
(``run.json``, the small files of an expert-parallel checkpoint, the final model's weights
while the others wait in a barrier: 600 s covers tens of GB at ordinary disk speeds). So 600 s
has a wide margin over every healthy wait, and a stopped rank ends the job in 10 minutes
rather than 30.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moelab.errors import DistributedTimeoutError, InvalidValueError

DEFAULT_DIST_TIMEOUT_S = 600.0
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: the largest limit accepted (larger ones overflow torch's millisecond counts)."""


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the data-parallel group (rank 0 of 1 when not distributed).

    Attributes:
        timeout_s: the process-group timeout, seconds (also the limit of the waits of
            :mod:`moelab.train.main_rank`).
    """

    rank: int = 0
    world_size: int = 1
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


def check_dist_timeout(seconds: float) -> float:
    """``seconds`` as a float when it is a finite number in (0, :data:`MAX_DIST_TIMEOUT_S`].

    Raises:
        InvalidValueError: otherwise, naming ``dist_timeout_s``.
    """
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= MAX_DIST_TIMEOUT_S
    ):
        raise InvalidValueError(
            f"dist_timeout_s: must be a number of seconds in (0, {MAX_DIST_TIMEOUT_S:g}], "
            f"got {seconds!r}"
        )
    return float(seconds)


def init_distributed(
    device: torch.device | None = None, timeout_s: float = DEFAULT_DIST_TIMEOUT_S
) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1): NCCL when
    this rank trains on a GPU (made the rank's current device), gloo on the CPU, with a
    ``timeout_s`` limit on every collective. A group that is already initialised (e.g. by
    :func:`moelab.parallel.launch.spawn_ranks`) keeps its own timeout.

    Raises:
        InvalidValueError: ``timeout_s`` is not in (0, :data:`MAX_DIST_TIMEOUT_S`].
    """
    timeout_s = check_dist_timeout(timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(timeout_s=timeout_s)
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s)


def timeout_error(exc: BaseException, info: DistInfo) -> DistributedTimeoutError | None:
    """The one-line error for ``exc`` when it is a collective's timeout in a distributed run
    (gloo raises a ``RuntimeError`` "Timed out waiting Nms for recv operation ..."), else
    None."""
    if not (info.enabled and isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()):
        return None
    return DistributedTimeoutError(
        f"rank {info.rank}: another rank did not answer for {info.timeout_s:g} s (it is "
        "stopped, hung or gone); stopped here, the last checkpoint stays valid "
        "(--dist-timeout sets the limit)"
    )


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
