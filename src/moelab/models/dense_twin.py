"""The dense twin of an MoE model and parameter counting (total vs. active per token).

Matching rule (compute-matched dense baseline): the twin is the same transformer
(embeddings, attention, norms, LM head, widths, depth) with one dense SwiGLU FFN per layer,
whose hidden width ``F_twin`` gives the FFN the parameters an MoE layer *activates per token*:

    active_moe = k·P_expert + P_shared + P_router
    P_expert   = 3·D·F  (swiglu: gate, up, down)   or 2·D·F (gelu: up, down)
    P_shared   = the shared expert (3·D·F_s for swiglu, plus D for its sigmoid gate)
    P_router   = E·D    (the router's [E, D] weight; plus any other router parameters)
    F_twin     = round(active_moe / (3·D))       # a dense SwiGLU FFN has 3·D·F_twin params

so for a swiglu MoE without extras ``F_twin = k·F + F_s + E/3`` (rounded). The counts are
taken from an actual :class:`~moelab.core.layer.MoELayer` built on the meta device, so any
parameter the layer has is included. With ``first_dense_layers > 0`` the twin's single
``dense_ffn_size`` matches the *mean* FFN active parameters over all layers (the already
dense layers enter with their own width), so the whole model's active parameters per token
still match. For expert-choice routing, ``k`` is the average number of experts per token.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moelab.core.config import MoEConfig
from moelab.core.experts.segmented import SegmentedExpertBank
from moelab.core.layer import MoELayer
from moelab.models.config import ModelConfig


def _routed_expert_params(layer: nn.Module, num_experts: int) -> int:
    """Parameters of the routed experts: tensors of ``layer.experts`` stacked over E (over
    each segment's experts for a grown or partly frozen bank)."""
    experts = getattr(layer, "experts", None)
    if experts is None:
        return 0
    if isinstance(experts, SegmentedExpertBank):
        banks = [(s, s.num_experts) for s in experts.segments]
    else:
        banks = [(experts, num_experts)]
    return sum(
        p.numel()
        for bank, n in banks
        for p in bank.parameters()
        if p.dim() >= 1 and p.shape[0] == n
    )


def moe_layer_params(moe: MoEConfig) -> dict[str, int]:
    """``{"total", "active_per_token", "routed_expert"}`` parameters of one MoE layer.

    ``active_per_token = total − (E − k)/E · routed_expert`` (a token uses k of the E routed
    experts; router, shared expert and everything else are always active).
    """
    with torch.device("meta"):
        layer = MoELayer(moe)
    return _layer_counts(layer, moe.router.num_experts, moe.router.top_k)


def _layer_counts(layer: nn.Module, E: int, k: int) -> dict[str, int]:
    total = sum(p.numel() for p in layer.parameters())
    routed = _routed_expert_params(layer, E)
    active = total - (routed * (E - k)) // E
    return {"total": total, "active_per_token": active, "routed_expert": routed}


def dense_twin_config(cfg: ModelConfig) -> ModelConfig:
    """The dense twin of ``cfg``: same model, ``moe=None``, every layer a dense SwiGLU FFN of
    width matched to the MoE's active parameters per token (rule in the module docstring).

    A config that is already dense is returned as an equal copy.
    """
    if cfg.moe is None or cfg.num_moe_layers == 0:
        return dataclasses.replace(cfg, moe=None, moe_layers=None)
    D = cfg.d_model
    active_moe = moe_layer_params(cfg.moe)["active_per_token"]
    dense = 3 * D * cfg.dense_ffn_size
    n_moe = cfg.num_moe_layers
    mean_active = (n_moe * active_moe + (cfg.n_layers - n_moe) * dense) / cfg.n_layers
    f_twin = max(1, round(mean_active / (3 * D)))
    return dataclasses.replace(
        cfg, moe=None, first_dense_layers=0, moe_layers=None, dense_ffn_size=f_twin
    )


def count_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts of a model (shared/tied tensors counted once).

    Returns:
        ``{"total", "active_per_token", "embedding", "active_non_embedding"}``:
        ``total`` all parameters; ``active_per_token`` what one token uses — ``total`` minus,
        in every MoE layer, the ``E − k`` routed experts it skips (embeddings and LM head
        included, as in Mixtral's "12.9B active"); ``embedding`` the input embedding (and
        the LM head when untied); ``active_non_embedding`` = active − embedding.
    """
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            moe = _moe_config_of(model, module)
            c = _layer_counts(module, moe.router.num_experts, moe.router.top_k)
            inactive += c["total"] - c["active_per_token"]
    embedding = 0
    seen: set[int] = set()
    for name in ("embed", "lm_head"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module):
            for p in sub.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    embedding += p.numel()
    active = total - inactive
    return {
        "total": total,
        "active_per_token": active,
        "embedding": embedding,
        "active_non_embedding": active - embedding,
    }


def _moe_config_of(model: nn.Module, layer: nn.Module) -> MoEConfig:
    for attr in ("cfg", "config"):
        c = getattr(layer, attr, None)
        if isinstance(c, MoEConfig):
            return c
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig) and cfg.moe is not None:
        return cfg.moe
    raise ValueError("model: cannot find the MoEConfig of an MoE layer (no .cfg/.config)")
