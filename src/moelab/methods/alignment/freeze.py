"""Per-expert trainability: train the LoRA adapters of chosen experts (and optionally the
routers), freeze everything else.

The adapters of one MoE layer are stacked ``[E, …]`` tensors, so "train experts {1, 4}" is a
gradient mask on rows of those tensors. With zero gradients and no weight decay on the
adapters (:func:`optimizer_groups`), AdamW leaves the masked rows bit-identical (its moments
stay 0), which the tests check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from moelab.errors import InvalidValueError
from moelab.models.transformer import MoETransformer

LORA_NAMES = ("lora_A_in", "lora_B_in", "lora_A_down", "lora_B_down")


def moe_layers(model: MoETransformer) -> list[int]:
    """Indices of the model's MoE blocks."""
    return [i for i, b in enumerate(model.blocks) if b.is_moe]


def train_only(
    model: MoETransformer,
    experts: Mapping[int, Sequence[int]] | None,
    *,
    routers: bool,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Make only the adapters of ``experts`` (MoE block index → expert ids; None = every
    expert of every MoE layer) and, with ``routers``, every router weight trainable.

    Returns the gradient-mask hooks (remove them to lift the masks).
    Raises:
        InvalidValueError: a model without adapters, a block that is not MoE, an expert id
            out of range.
    """
    if model.cfg.moe is None or not model.cfg.moe.experts.lora_rank:
        raise InvalidValueError("model: has no LoRA adapters (add them with add_expert_lora)")
    layers = moe_layers(model)
    if experts is not None:
        for layer, ids in experts.items():
            if layer not in layers:
                raise InvalidValueError(f"experts: block {layer} is not an MoE layer ({layers})")
            E = model.blocks[layer].ffn.config.router.num_experts
            if any(not 0 <= e < E for e in ids):
                raise InvalidValueError(
                    f"experts: block {layer} ids must be in [0, {E}), got {list(ids)}"
                )
    for p in model.parameters():
        p.requires_grad_(False)
    handles = []
    for layer in layers:
        ffn = model.blocks[layer].ffn
        if routers:
            ffn.router.weight.requires_grad_(True)
        E = ffn.config.router.num_experts
        keep = torch.zeros(E, dtype=torch.bool)
        keep[list(range(E)) if experts is None else list(experts.get(layer, ()))] = True
        if not keep.any():
            continue
        for name in LORA_NAMES:
            p = getattr(ffn.experts, name)
            p.requires_grad_(True)
            if not keep.all():
                m = keep.to(p.dtype).view(E, *([1] * (p.dim() - 1)))
                handles.append(p.register_hook(lambda g, m=m: g * m))
    return handles


def optimizer_groups(
    model: nn.Module, lora_lr: float, router_lr: float, weight_decay: float = 0.0
) -> list[dict]:
    """AdamW parameter groups: adapters at ``lora_lr`` without weight decay (a decayed
    masked row would move), routers at ``router_lr`` with ``weight_decay``."""
    lora, router = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (lora if name.rsplit(".", 1)[-1] in LORA_NAMES else router).append(p)
    groups = [{"params": lora, "lr": lora_lr, "weight_decay": 0.0}]
    if router:
        groups.append({"params": router, "lr": router_lr, "weight_decay": weight_decay})
    return groups
