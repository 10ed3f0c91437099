"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for an expert-parallel model (torchtitan's
``apply_fsdp``, reduced to what moelab's models need).

- Experts (the expert banks of :func:`moelab.parallel.shard.shard_model`, MoE layers and
  Multi-Head LatentMoE heads): when ``EP > 1`` and ``DP > 1``, each EP rank's bank is
  ``fully_shard``-ed over its DP group (the ``DP`` ranks holding the same expert shard:
  torchtitan's ``dp_mod_ep`` mesh), so its weights and their optimizer state are split
  DP ways instead of replicated. Gradients: backward through the all-to-all already summed
  ``∂L_r/∂θ`` over the ranks r of the EP group into the owner; FSDP2's reduce-scatter sums the
  rest over the DP group and divides by DP, and :func:`moelab.parallel.grads.sync_gradients`
  divides the local slice by EP, so the result is the global mean ``(1/W) Σ_r ∂L_r/∂θ``
  (``W = DP·EP``), as for the unsharded case. (torchtitan sets FSDP2's gradient divide
  factor to W instead; that uses ``ReduceOp.PREMUL_SUM``, which gloo lacks.) With ``DP == 1`` there is nothing to split and the banks keep the
  hand reduction. Head Parallel's router and expert bias stay replicated (small).
- Everything else: every decoder block and then the root model (embedding, final norm, LM
  head) are sharded over the whole world (a 1-D mesh of all W ranks), parameter by parameter
  along dim 0; FSDP2 averages their gradients over W. Expert shards not sharded above are
  passed as ``ignored_params`` and keep their DP-group reduction.

FSDP2 all-gathers a module's parameters before its forward and backward and reduce-scatters
its gradients. Measured on this project's machine: PyTorch 2.13's FSDP2 runs on CPU with the
gloo backend (``tests/parallel`` trains with it). Choice: parameters are resharded after
forward (FSDP2's default), no mixed precision, no CPU offload.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moelab.core.latent_moe import MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.parallel.comm import ParallelGroups


def expert_banks(model: nn.Module) -> list[nn.Module]:
    """The expert banks of ``model``'s MoE and Multi-Head LatentMoE layers, in module order."""
    return [m.experts for m in model.modules() if isinstance(m, (MoELayer, MultiHeadLatentMoE))]


def apply_fsdp(model: nn.Module, sharded: set[str], groups: ParallelGroups) -> nn.Module:
    """Wrap ``model`` (a MoETransformer whose experts :func:`~moelab.parallel.shard.shard_model`
    has cut, names in ``sharded``) in place; returns it.

    Raises:
        InvalidValueError: not running distributed.
    """
    if not groups.enabled:
        raise InvalidValueError(
            "--fsdp: needs a distributed run (torchrun with 2 or more processes)"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if groups.ep > 1 and groups.dp > 1:  # the experts over the DP group of their EP shard
        for bank in expert_banks(model):
            fully_shard(bank, mesh=groups.mesh["dp"])
    mesh = init_device_mesh(device, (groups.world_size,), mesh_dim_names=("fsdp",))
    ignored = {
        p for n, p in model.named_parameters() if n in sharded and not isinstance(p, DTensor)
    }
    for block in model.blocks:
        own = {p for p in block.parameters() if p in ignored}
        fully_shard(block, mesh=mesh, ignored_params=own or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    return model
