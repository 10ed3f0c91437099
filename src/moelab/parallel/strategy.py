"""ExpertParallel: what ``moelab train`` calls to run one run on ``world = DP × EP`` ranks.

The training loop (:func:`moelab.train.loop.train`, argument ``parallel``) stays the same
loop; this object replaces its DistributedDataParallel wrapper, its gradient clipping, its
checkpoint files and its final save:

- :meth:`prepare`: check the layout, shard experts / heads over the EP group
  (:mod:`moelab.parallel.shard`), optionally FSDP2 the rest (:mod:`moelab.parallel.fsdp`);
- :meth:`sync_gradients` / :meth:`clip_grad_norm`: :mod:`moelab.parallel.grads`;
- :meth:`save_checkpoint` / :meth:`load_checkpoint`: DCP (:mod:`moelab.parallel.checkpoint`);
- :meth:`save_model`: gathers the full model and writes a normal model folder on rank 0.

Routers of MoE layers stay replicated and route their own rank's tokens, so the
aux-loss-free bias update and the global-batch load-balancing loss reduce their counts over
the whole world (every rank holds different tokens of the global batch), which is what
``update_expert_bias`` and ``GlobalBalanceLoss`` do; Multi-Head LatentMoE heads reduce over
their DP group (:mod:`moelab.parallel.head_parallel`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moelab.errors import InvalidValueError
from moelab.models import CheckpointError, MoETransformer, save_model
from moelab.parallel.checkpoint import latest_sharded_dir, load_sharded, read_layout, save_sharded
from moelab.parallel.comm import ParallelGroups, build_groups, check_expert_parallel
from moelab.parallel.fsdp import apply_fsdp
from moelab.parallel.grads import clip_grad_norm, sync_gradients
from moelab.parallel.shard import check_shardable, full_state_dict, shard_model


class ExpertParallel:
    """Expert parallelism (and optionally FSDP2) for one training run.

    Args:
        expert_parallel: EP, ranks per expert-parallel group (divides the world size, the
            experts of every MoE layer and the heads of every Multi-Head LatentMoE layer).
        fsdp: shard the non-expert parameters with FSDP2 over the world, and (EP > 1 and
            DP > 1) each EP rank's experts over its DP group (:mod:`moelab.parallel.fsdp`).
    Raises:
        ValueError: EP is not an int >= 1 dividing the world size (``WORLD_SIZE``).
    """

    def __init__(self, expert_parallel: int = 1, fsdp: bool = False) -> None:
        # torchrun's WORLD_SIZE lets a bad EP fail before any data is loaded
        check_expert_parallel(expert_parallel, int(os.environ.get("WORLD_SIZE", "1")))
        self.ep = expert_parallel
        self.fsdp = fsdp
        self.groups = ParallelGroups()
        self.sharded: list[str] = []
        self._sharded_set: set[str] = set()

    # ------------------------------------------------------------------ setup
    def prepare(self, model: MoETransformer, timeout: timedelta | None = None) -> MoETransformer:
        """Validate and shard ``model`` in place for this rank; call on every rank before any
        file is written. ``timeout`` limits each collective of the EP and DP groups (None:
        torch's default; :func:`moelab.train.loop.train` passes its ``dist_timeout_s``).
        Raises ValueError for a layout that does not fit."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        check_expert_parallel(self.ep, world)
        check_shardable(model, self.ep)
        if self.fsdp and world < 2:
            raise InvalidValueError(
                "--fsdp: needs a distributed run (torchrun with 2 or more processes)"
            )
        self.groups = build_groups(self.ep, timeout)
        self.sharded = shard_model(model, self.groups)
        self._sharded_set = set(self.sharded)
        if self.fsdp:
            apply_fsdp(model, self._sharded_set, self.groups)
        return model

    @property
    def layout(self) -> dict[str, Any]:
        return {"world_size": self.groups.world_size, "expert_parallel": self.ep, "fsdp": self.fsdp}

    # ------------------------------------------------------------------ steps
    def sync_gradients(self, model: nn.Module) -> None:
        sync_gradients(model, self._sharded_set, self.groups)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return clip_grad_norm(model, max_norm, self._sharded_set, self.groups)

    def expert_state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds of the expert / head shards' parameters and their optimizer
        state tensors (FSDP2's local slices when the experts are sharded over DP; scalar
        state such as Adam's ``step`` left out): the memory FSDP2 on the experts divides by
        DP."""
        total = 0
        for name, p in model.named_parameters():
            if name not in self._sharded_set:
                continue
            tensors = [p, *(v for v in optimizer.state.get(p, {}).values() if v.dim())]
            for t in tensors:
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
        return total

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        run_dir: Path,
        model: MoETransformer,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        step: int,
    ) -> Path:
        return save_sharded(
            run_dir, model, optimizer, state, step, self.sharded, self.groups, self.fsdp
        )

    def check_resume(self, run_dir: Path) -> Path | None:
        """The checkpoint a resume would load, after checking it fits this world size
        (the batch-sampler state is per rank). Raises CheckpointError otherwise."""
        folder = latest_sharded_dir(run_dir)
        if folder is None:
            return None
        layout = read_layout(folder)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if layout.get("world_size") != world:
            raise CheckpointError(
                f"{folder}: written by {layout.get('world_size')} ranks, this run has {world}; "
                f"resume with --nproc-per-node {layout.get('world_size')} (the weights load at "
                "any size: `moelab consolidate` makes a model folder to --init-from)"
            )
        return folder

    def load_checkpoint(
        self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """Load the latest checkpoint into the sharded ``model`` and ``optimizer`` (any EP at
        the same world size). Returns the trainer state, or None when there is none."""
        folder = self.check_resume(run_dir)
        if folder is None:
            return None
        return load_sharded(folder, model, self.sharded, self.groups, optimizer)

    def save_model(self, model: nn.Module, folder: Path) -> None:
        """Gather the full model and write a normal model folder on rank 0 (collective)."""
        state = full_state_dict(model, self.sharded, self.groups)
        if self.groups.rank == 0:
            full = MoETransformer(model.cfg)
            full.load_state_dict(state)
            save_model(full, folder)
        if self.groups.enabled:
            dist.barrier()
