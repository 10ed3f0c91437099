"""Swap the router of a trained model (training-free routing changes, e.g. USMoE budgets)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from moelab.core.config import RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.routers import Router, build_router
from moelab.models.transformer import MoETransformer


def with_router(
    model: MoETransformer,
    router: RouterConfig | Callable[[RouterConfig, int], Router],
) -> MoETransformer:
    """A deep copy of ``model`` whose MoE layers route with a new rule but the learned weight.

    Every MoE layer's router is rebuilt — from ``router`` (a :class:`RouterConfig`, e.g.
    ``kind="usmoe", budget_fraction=0.86``), or by calling ``router(old_config, hidden_size)``
    for a custom :class:`Router` — and its ``weight`` ``[E, D]`` is copied from the trained
    router (so are ``expert_bias`` buffers when both have one). The copy's configs
    (``model.cfg.moe.router`` and each layer's) name the new router, so a saved copy reloads
    with it. The original model is not modified.

    A USMoE config with ``usmoe_weight_norm="auto"`` takes ``"selected"`` when the trained
    router renormalised its top-k weights (``norm_topk_prob`` with k > 1: its experts saw
    weights summing to 1) and ``"none"`` otherwise, so the swap keeps the output scale.

    Raises:
        ValueError: the model has no MoE layer, or the new router's E differs.
    """
    new = copy.deepcopy(model)
    layers = [m for m in new.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("model: has no MoE layer whose router could be swapped")
    for layer in layers:
        old = layer.router
        D = old.weight.shape[1]
        if isinstance(router, RouterConfig):
            cfg = _resolve_weight_norm(router, old.config)
            fresh = build_router(cfg, D)
        else:
            fresh = router(old.config, D)
            cfg = fresh.config
        if cfg.num_experts != old.config.num_experts:
            raise ValueError(
                f"router: has num_experts={cfg.num_experts}, the model {old.config.num_experts}"
            )
        with torch.no_grad():
            fresh.weight.copy_(old.weight)
            old_bias = getattr(old, "expert_bias", None)
            if getattr(fresh, "expert_bias", None) is not None and old_bias is not None:
                fresh.expert_bias.copy_(old_bias)
        fresh.to(device=old.weight.device, dtype=old.weight.dtype)
        fresh.train(old.training)
        layer.router = fresh
        layer.config = dataclasses.replace(layer.config, router=cfg)
    if new.cfg.moe is not None and isinstance(router, RouterConfig):
        new.cfg.moe = dataclasses.replace(
            new.cfg.moe, router=_resolve_weight_norm(router, new.cfg.moe.router)
        )
    return new


def _resolve_weight_norm(new: RouterConfig, trained: RouterConfig) -> RouterConfig:
    """``usmoe_weight_norm="auto"`` made concrete from the trained router's weighting."""
    if new.kind != "usmoe" or new.usmoe_weight_norm != "auto":
        return new
    renormalised = trained.norm_topk_prob or (
        trained.score_func == "softmax" and not trained.softmax_before_topk
    )
    normalised = trained.kind == "token_choice" and trained.top_k > 1 and renormalised
    return dataclasses.replace(new, usmoe_weight_norm="selected" if normalised else "none")
