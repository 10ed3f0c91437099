"""Shard a model's experts (MoE layers) and heads (Multi-Head LatentMoE layers) over the EP
group, and gather the shards back into a full state dict.

Every sharded tensor is cut along dim 0 in EP-rank order, so the full tensor is the
concatenation of the ranks' shards:
- MoELayer: every per-expert tensor of the bank (``experts.w_gate_up``/``w_up`` ``[E, D, ·]``,
  ``experts.w_down`` ``[E, F, D]``, biases, LoRA adapters) → E/EP experts per rank, cut by the
  bank itself (:mod:`moelab.core.experts.select`), so each parameter keeps its
  ``requires_grad`` (frozen LoRA bases stay frozen); the router stays replicated (every rank
  routes its own tokens). Bank kinds that cannot be cut (quantized, offloaded) are refused by
  :func:`check_shardable`, naming the layer.
- MultiHeadLatentMoE: ``router [H, E, d_h]``, ``expert_bias [H, E]`` and the expert bank
  ``[H·E, ·, ·]`` → H/EP heads per rank; ``fc_mh`` and ``fc_mg`` stay replicated.

Choice: the model is first built whole on every rank from the same seed and then cut, so an
EP run starts from exactly the single-process initialisation (torchtitan builds on the meta
device instead; our models are small).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moelab.core.experts.select import check_selectable
from moelab.core.latent_moe import MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.parallel.comm import ParallelGroups
from moelab.parallel.expert_parallel import AllToAllDispatcher
from moelab.parallel.head_parallel import HeadParallelDispatcher


def check_shardable(model: nn.Module, ep: int) -> None:
    """Raise ValueError naming the layer when ``ep`` does not divide its experts or heads, or
    the layer uses something expert parallelism does not support (the specialization loss, an
    expert bank that cannot be cut: see :func:`moelab.core.experts.select.check_selectable`)."""
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            if ep > 1:
                check_selectable(m.experts, f"layer {name}", "--expert-parallel")
            E = m.config.router.num_experts
            if E % ep:
                raise InvalidValueError(
                    f"--expert-parallel: {ep} does not divide the {E} experts of layer {name}"
                )
            if ep > 1 and m.specialization_loss is not None:
                raise InvalidValueError(
                    "--expert-parallel: the specialization loss reads every pair's activations "
                    "on the token's rank and is not supported with expert parallelism"
                )
        elif isinstance(m, MultiHeadLatentMoE):
            H = m.config.num_heads
            if H % ep:
                raise InvalidValueError(
                    f"--expert-parallel: {ep} ranks do not divide the {H} heads of the "
                    f"Multi-Head LatentMoE layer {name}"
                )


@torch.no_grad()
def shard_model(model: nn.Module, groups: ParallelGroups) -> list[str]:
    """Cut the experts / heads of every sparse layer to this rank's shard and install the
    all-to-all / Head Parallel dispatchers (in place).

    Returns:
        The state-dict names of the sharded tensors (parameters and buffers).
    Raises:
        ValueError: see :func:`check_shardable`.
    """
    check_shardable(model, groups.ep)
    sharded: list[str] = []
    if groups.ep == 1:
        return sharded
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            E = m.config.router.num_experts
            n = E // groups.ep
            rows = torch.arange(groups.ep_rank * n, (groups.ep_rank + 1) * n)
            m.experts = m.experts.select_experts(rows)
            m.dispatcher = AllToAllDispatcher(groups.ep_group, E)
            sharded += [f"{name}.experts.{k}" for k in m.experts.state_dict()]
        elif isinstance(m, MultiHeadLatentMoE):
            hp = HeadParallelDispatcher(groups.ep_group, m.config.num_heads, groups.dp_group)
            m.shard_heads(hp.head_offset, hp.local_heads)
            m.head_dispatcher = hp
            sharded += [f"{name}.router", f"{name}.expert_bias"]
            sharded += [f"{name}.experts.{k}" for k in m.experts.state_dict()]
    return sharded


def full_tensor(t: Tensor, name: str, sharded: set[str], groups: ParallelGroups) -> Tensor:
    """The whole tensor behind this rank's ``t``: EP shards are all-gathered along dim 0,
    FSDP2 DTensors are ``full_tensor()``-ed, replicated tensors returned as they are."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    if name in sharded and groups.ep > 1:
        parts = [torch.empty_like(t) for _ in range(groups.ep)]
        dist.all_gather(parts, t.contiguous(), group=groups.ep_group)
        t = torch.cat(parts)
    return t.detach()


def full_state_dict(model: nn.Module, sharded: list[str], groups: ParallelGroups) -> dict:
    """The single-process state dict of a sharded model, on every rank (collective)."""
    keep = set(sharded)
    return {k: full_tensor(v, k, keep, groups) for k, v in model.state_dict().items()}
