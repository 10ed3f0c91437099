"""Process groups of expert parallelism and a differentiable ``all_to_all_single``.

Layout (torchtitan / Megatron-Core): ``world = DP × EP``; global rank ``r = d·EP + e``. The EP
group of rank r is the EP contiguous ranks of its data-parallel replica ``d`` (experts and
heads are sharded over it); its DP group is the DP ranks holding the same shard ``e`` (the
gradients of sharded parameters are reduced over it). A 2-D device mesh ``("dp", "ep")``
describes the same layout for FSDP2 and Distributed Checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from moelab.errors import InvalidValueError


@dataclass
class ParallelGroups:
    """This rank's place in ``world = DP × EP``.

    Attributes:
        world_size, rank: of the default process group.
        ep, dp: group sizes (``ep · dp == world_size``).
        ep_rank, dp_rank: this rank's index in its EP / DP group.
        mesh: the ``("dp", "ep")`` DeviceMesh (None when not distributed).
        expert_mesh: the same ranks as an ``("ep", "dp")`` DeviceMesh (None when not
            distributed): a tensor sharded over EP and then, inside each EP shard, over DP
            (FSDP2 on the experts, :mod:`moelab.parallel.fsdp`) is ``[Shard(0), Shard(0)]``
            on it, so its global dim-0 order is EP-major, as the unsharded checkpoint's.
    """

    world_size: int = 1
    rank: int = 0
    ep: int = 1
    dp: int = 1
    mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep

    @property
    def ep_group(self):
        return self.mesh.get_group("ep") if self.mesh is not None else None

    @property
    def dp_group(self):
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def check_expert_parallel(ep: int, world_size: int) -> None:
    """Raise InvalidValueError unless ``ep`` is an int >= 1 dividing ``world_size``."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world_size % ep:
        raise InvalidValueError(
            f"--expert-parallel: must be an int >= 1 dividing the world size {world_size}, "
            f"got {ep!r}"
        )


def build_groups(ep: int, timeout: timedelta | None = None) -> ParallelGroups:
    """The groups for EP size ``ep`` in the initialised default process group (or a
    single-process layout when ``torch.distributed`` is not initialised and ``ep == 1``).

    Args:
        timeout: the limit of every collective on the EP and DP groups (None: torch's
            default, 30 minutes for gloo). A group spanning the whole world is the default
            group, with the timeout it was made with.
    Raises:
        ValueError: ``ep`` does not divide the world size.
    """
    if not (dist.is_available() and dist.is_initialized()):
        check_expert_parallel(ep, 1)
        return ParallelGroups()
    world = dist.get_world_size()
    check_expert_parallel(ep, world)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    layout = torch.arange(world).view(world // ep, ep)  # r = d·EP + e
    # init_device_mesh would make its subgroups with torch's default timeout, whatever the
    # default group's: the groups are made here with ``timeout`` and wrapped in a mesh
    groups = [_own_group(layout.t(), timeout), _own_group(layout, timeout)]
    mesh = DeviceMesh.from_group(groups, device, mesh=layout, mesh_dim_names=("dp", "ep"))
    expert_mesh = DeviceMesh.from_group(
        groups[::-1], device, mesh=layout.t(), mesh_dim_names=("ep", "dp")
    )
    return ParallelGroups(
        world_size=world,
        rank=dist.get_rank(),
        ep=ep,
        dp=world // ep,
        mesh=mesh,
        expert_mesh=expert_mesh,
    )


def _own_group(rows: Tensor, timeout: timedelta | None) -> dist.ProcessGroup:
    """This rank's group among the groups ``rows`` (one per row of global ranks). Every rank
    makes every group, in the same order, as ``new_group`` requires."""
    if rows.shape[1] == dist.get_world_size():
        return dist.group.WORLD
    mine = None
    for ranks in rows.tolist():
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


@dataclass
class CommStats:
    """Bytes this rank sent to other ranks (its own slice excluded), forward passes only.

    Attributes:
        payload_bytes: token rows / sub-tokens.
        metadata_bytes: per-expert counts (EP's count exchange; 0 for Head Parallel).
        calls: forward layer calls counted.
        per_call: payload+metadata bytes of each call (a list, for per-layer figures).
    """

    payload_bytes: int = 0
    metadata_bytes: int = 0
    calls: int = 0
    per_call: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.payload_bytes = self.metadata_bytes = self.calls = 0
        self.per_call = []

    def add(self, payload: int, metadata: int = 0, new_call: bool = True) -> None:
        """Count one exchange; ``new_call=False`` adds it to the current layer call."""
        self.payload_bytes += payload
        self.metadata_bytes += metadata
        if new_call:
            self.calls += 1
            self.per_call.append(payload + metadata)
        else:
            self.per_call[-1] += payload + metadata


def sent_bytes(splits: list[int], row_bytes: int, my_rank: int) -> int:
    """Bytes of an all-to-all send with ``splits`` rows per destination, self excluded."""
    return row_bytes * sum(n for r, n in enumerate(splits) if r != my_rank)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0.

    Args:
        x: ``[sum(in_splits), ...]``; rows ``in_splits[r]`` go to rank r of ``group``.
        out_splits: rows received from each rank.
    Returns:
        ``[sum(out_splits), ...]``, rows grouped by source rank. Backward runs the reverse
        exchange.
    """
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)
