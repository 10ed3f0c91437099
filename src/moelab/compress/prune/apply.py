"""Remove experts from MoE layers: slice the expert bank, the router rows and the expert-bias
buffer; clamp top-k; keep shared experts and everything else bit for bit.

The routing maths is unchanged (RaGEP's ``FinalPrunedMoE`` and NAEE's ``prune`` keep softmax,
top-k and renormalisation as they were), so a pruned layer computes exactly what the unpruned
layer computes with the removed experts' router logits set to −∞ (for every token-choice rule:
softmax before or after top-k, sigmoid, expert bias). The pruned model's config records the
per-layer expert counts (``ModelConfig.experts_per_layer``), so it saves and reloads with exactly
its own shapes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer

# state-dict entries of an MoE layer whose leading dimension is the routed expert
_PER_EXPERT = (
    "router.weight",
    "router.expert_bias",
    "experts.w_gate_up",
    "experts.w_up",
    "experts.w_down",
)


def check_prunable(layer: MoELayer, where: str = "layer") -> None:
    """Raise ValueError unless ``layer`` uses dropless-or-capacity token-choice routing
    without group limits (expert choice and USMoE select over tokens, group-limited routing
    needs equal groups, so removing experts would change their rules)."""
    r = layer.config.router
    if r.kind != "token_choice":
        raise InvalidValueError(
            f"{where}: expert pruning needs token-choice routing, got kind={r.kind!r}"
        )
    if r.n_group is not None:
        raise InvalidValueError(
            f"{where}: group-limited routing (n_group={r.n_group}) cannot lose experts: "
            "its groups must stay equal"
        )


@torch.no_grad()
def prune_layer(layer: MoELayer, keep: Sequence[int]) -> MoELayer:
    """A new MoE layer with only the routed experts ``keep`` (in ascending order).

    Args:
        layer: a token-choice MoE layer with E experts.
        keep: distinct expert indices in ``[0, E)``, at least one.
    Returns:
        A layer with ``len(keep)`` experts, ``top_k = min(top_k, len(keep))``, on the same
        device and dtype.
    Raises:
        ValueError: bad ``keep`` or an unprunable router (see :func:`check_prunable`).
    """
    check_prunable(layer)
    E = layer.experts.num_experts
    idx = sorted(int(i) for i in keep)
    if not idx or len(set(idx)) != len(idx) or idx[0] < 0 or idx[-1] >= E:
        raise InvalidValueError(
            f"keep: must be distinct expert indices in [0, {E}), got {list(keep)}"
        )
    r = layer.config.router
    router = dataclasses.replace(r, num_experts=len(idx), top_k=min(r.top_k, len(idx)))
    new = MoELayer(dataclasses.replace(layer.config, router=router), layer.dispatcher)
    p = layer.experts.w_down
    new = new.to(device=p.device, dtype=p.dtype)
    if getattr(layer.router, "expert_bias", None) is not None:
        new.router.expert_bias = new.router.expert_bias.to(layer.router.expert_bias.dtype)
    index = torch.tensor(idx, device=p.device)
    state = {
        k: (v.index_select(0, index.to(v.device)) if k in _PER_EXPERT else v).clone()
        for k, v in layer.state_dict().items()
    }
    new.load_state_dict(state, strict=True)
    new.experts.backend = layer.experts.backend
    new.train(layer.training)
    return new


def pruned_config(cfg: ModelConfig, counts: Sequence[int]) -> ModelConfig:
    """``cfg`` with ``counts[j]`` routed experts in MoE layer j: uniform counts become a plain
    config (``moe.router.num_experts = n``, top-k clamped), different counts set
    ``experts_per_layer`` (``moe.router.num_experts`` = the largest count)."""
    if cfg.moe is None or len(counts) != cfg.num_moe_layers:
        raise InvalidValueError(f"counts: need {cfg.num_moe_layers} entries (one per MoE layer)")
    r = cfg.moe.router
    top = max(counts)
    router = dataclasses.replace(r, num_experts=top, top_k=min(r.top_k, top))
    moe = dataclasses.replace(cfg.moe, router=router)
    per_layer = None if len(set(counts)) == 1 else tuple(int(c) for c in counts)
    return dataclasses.replace(cfg, moe=moe, experts_per_layer=per_layer)


def apply_pruning(
    model: MoETransformer, keeps: Sequence[Sequence[int] | None], *, inplace: bool = False
) -> MoETransformer:
    """Prune every MoE layer j to the experts ``keeps[j]`` (None leaves the layer as is).

    Args:
        model: the model; copied first unless ``inplace``.
        keeps: one entry per MoE layer in depth order.
    Returns:
        The pruned model, whose ``cfg`` describes its layers exactly.
    Raises:
        ValueError: wrong number of entries, bad indices, or an unprunable router.
    """
    blocks = [b for b in model.blocks if b.is_moe]
    if len(keeps) != len(blocks):
        raise InvalidValueError(
            f"keeps: need {len(blocks)} entries (one per MoE layer), got {len(keeps)}"
        )
    out = model if inplace else copy.deepcopy(model)
    blocks = [b for b in out.blocks if b.is_moe]
    for block, keep in zip(blocks, keeps, strict=True):
        if keep is not None:
            block.ffn = prune_layer(block.ffn, keep)
    out.cfg = pruned_config(out.cfg, [b.ffn.experts.num_experts for b in blocks])
    return out
