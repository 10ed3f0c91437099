"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the non-expert parameters of an
expert-parallel model (torchtitan's ``apply_fsdp``, reduced to what moelab's models need).

Every decoder block and then the root model (embedding, final norm, LM head) are sharded over
the whole world (a 1-D mesh of all W ranks), parameter by parameter along dim 0; the expert and
head shards of :func:`moelab.parallel.shard.shard_model` are passed as ``ignored_params`` and
keep their own DP-group reduction (:mod:`moelab.parallel.grads`). FSDP2 all-gathers a block's
parameters before its forward and backward and reduce-scatters (averages over W) its gradients.

Measured on this project's machine: PyTorch 2.13's FSDP2 runs on CPU with the gloo backend
(``tests/parallel`` trains with it). Choice: parameters are resharded after forward (FSDP2's
default), no mixed precision, no CPU offload.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from moelab.errors import InvalidValueError
from moelab.parallel.comm import ParallelGroups


def apply_fsdp(model: nn.Module, sharded: set[str], groups: ParallelGroups) -> nn.Module:
    """Wrap ``model`` (a MoETransformer) in place; returns it.

    Raises:
        ValueError: not running distributed.
    """
    if not groups.enabled:
        raise InvalidValueError(
            "--fsdp: needs a distributed run (torchrun with 2 or more processes)"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (groups.world_size,), mesh_dim_names=("fsdp",))
    ignored = {p for n, p in model.named_parameters() if n in sharded}
    for block in model.blocks:
        own = {p for p in block.parameters() if p in ignored}
        fully_shard(block, mesh=mesh, ignored_params=own or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    return model
