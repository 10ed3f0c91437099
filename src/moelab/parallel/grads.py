"""Gradient reduction and global-norm clipping under ``world = DP × EP`` (± FSDP2).

With every rank's loss the mean over its own tokens, the global loss is the mean of the W
ranks' losses, so every gradient must be ``(1/W) Σ_r ∂L_r/∂θ``:
- replicated parameters (attention, norms, embeddings, routers of MoE layers, fc_mh/fc_mg):
  ``all_reduce`` over the whole world, divided by W (FSDP2 does this itself for the parameters
  it manages, by reduce-scatter with the same 1/W average);
- sharded parameters (experts, Multi-Head LatentMoE heads): backward through the all-to-all
  already summed ``∂L_r/∂θ`` over the r of this EP group into the shard's owner, so the
  remaining sum runs over the DP group only (the replicas of the same shard), then ÷ W
  (Megatron-Core's expert-data-parallel reduction). When FSDP2 shards them over the DP group
  (:mod:`moelab.parallel.fsdp`) its reduce-scatter did the DP sum and ÷ DP; the remaining
  ÷ EP is applied here to the local slice.

The global gradient norm for clipping adds replicated squares once, FSDP2 shards summed over
the world and expert shards summed over the EP group, and scales every gradient by
``max_norm / (norm + 1e-6)`` clamped to 1, as ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moelab.parallel.comm import ParallelGroups


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "to_local")


def _all_reduce_mean(grads: list[Tensor], group, world: int) -> None:
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(reduced)


@torch.no_grad()
def sync_gradients(model: nn.Module, sharded: set[str], groups: ParallelGroups) -> None:
    """Average the gradients of one optimizer step (see the module docstring). Parameters
    without a gradient get a zero one so every rank reduces the same tensors."""
    if not groups.enabled:
        return
    replicated, shards = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _is_dtensor(p):
            if name in sharded and p.grad is not None and groups.ep > 1:
                p.grad.to_local().div_(groups.ep)  # FSDP2 averaged over DP only
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (shards if name in sharded else replicated).append(p.grad)
    _all_reduce_mean(replicated, None, groups.world_size)
    _all_reduce_mean(shards, groups.dp_group, groups.world_size)


@torch.no_grad()
def clip_grad_norm(
    model: nn.Module, max_norm: float, sharded: set[str], groups: ParallelGroups
) -> float:
    """Clip to the global norm over all ranks' shards; returns the norm before clipping."""
    dev = next(model.parameters()).device
    sq = {"rep": torch.zeros((), device=dev), "fsdp": torch.zeros((), device=dev)}
    sq["ep"] = torch.zeros((), device=dev)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if _is_dtensor(g):
            local = g.to_local()
            sq["fsdp"] += local.float().pow(2).sum()
            grads.append(local)
        else:
            sq["ep" if name in sharded else "rep"] += g.float().pow(2).sum()
            grads.append(g)
    if groups.enabled:
        dist.all_reduce(sq["fsdp"])
        if groups.ep > 1:
            dist.all_reduce(sq["ep"], group=groups.ep_group)
    total = (sq["rep"] + sq["fsdp"] + sq["ep"]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return float(total)
