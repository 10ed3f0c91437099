"""Make a model whose experts grew or were frozen (:mod:`moelab.core.growth`) saveable again.

:func:`moelab.core.growth.grow_experts` and ``freeze_experts`` change one MoE layer; the
model's config still describes the old layers and a segmented bank's tensors have other
names, so :func:`moelab.models.save_model` refuses such a model. :func:`consolidate_model_experts`
turns every segmented bank into a plain ``ExpertBank`` and writes the per-layer expert counts
into the config (``experts_per_layer``), after which the model saves, loads and computes the
same outputs. The freezing is not saved: after loading, call ``freeze_experts`` again.
"""

from __future__ import annotations

import dataclasses

from moelab.core.growth import consolidate_experts
from moelab.errors import InvalidValueError
from moelab.models.transformer import MoETransformer


def consolidate_model_experts(model: MoETransformer) -> MoETransformer:
    """Consolidate every segmented expert bank of ``model`` and update ``model.cfg`` (in
    place; returns ``model``). ``cfg.moe.router.num_experts`` becomes the largest layer's
    count, and ``experts_per_layer`` lists them when they differ.

    Raises:
        InvalidValueError: a dense model, or a layer whose router config the model config
            cannot express (e.g. its top-k was clamped by pruning before it grew past it).
    """
    cfg = model.cfg
    if cfg.moe is None or cfg.num_moe_layers == 0:
        raise InvalidValueError("model: has no MoE layers")
    layers = [(b.layer_idx, b.ffn) for b in model.blocks if b.is_moe]
    counts = [layer.experts.num_experts for _, layer in layers]
    router = dataclasses.replace(cfg.moe.router, num_experts=max(counts))
    new = dataclasses.replace(
        cfg,
        moe=dataclasses.replace(cfg.moe, router=router),
        experts_per_layer=None if len(set(counts)) == 1 else tuple(counts),
    )
    for i, layer in layers:
        if layer.config != new.moe_config(i):
            raise InvalidValueError(
                f"model: layer {i}'s MoE config differs from what the model config can express "
                f"for it (experts {layer.config.router.num_experts}, top_k "
                f"{layer.config.router.top_k}; the config gives top_k "
                f"{new.moe_config(i).router.top_k} and other fields must match too)"
            )
    for _, layer in layers:
        consolidate_experts(layer)
    model.cfg = new
    return model
