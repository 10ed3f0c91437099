"""Remove experts from MoE layers: cut every per-expert tensor (the bank's weights, biases and
LoRA adapters through the bank's own ``select_experts``; the router rows, the expert-bias buffer
and any other per-expert state of the layer as :mod:`moelab.core.experts.select` finds them);
clamp top-k; keep shared experts and everything else bit for bit, each parameter with its
``requires_grad``.

The routing maths is unchanged (RaGEP's ``FinalPrunedMoE`` and NAEE's ``prune`` keep softmax,
top-k and renormalisation as they were), so a **dropless** pruned layer computes exactly what
the unpruned layer computes with the removed experts' router logits set to −∞ (softmax before
or after top-k, sigmoid, expert bias). With a capacity factor ``c`` it does not: the pruned
layer keeps ``c`` and divides the ``T·k`` pairs over its own ``E'`` experts, capacity
``ceil(T·k'/E' · c)`` (Megatron-Core's ``get_capacity``, the configured factor unchanged),
larger than the original's ``ceil(T·k/E · c)``, so it drops fewer pairs than the masked
original would (criteria that model the pruned layer by masking, NAEE, refuse such layers
before calibrating). The pruned model's config records the
per-layer expert counts (``ModelConfig.experts_per_layer``), so it saves and reloads with exactly
its own shapes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import torch

from moelab.core.experts.select import check_selectable, expert_layout, take_experts
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer


def _builder(layer: MoELayer) -> Callable[[int], MoELayer]:
    """``build(n)``: an empty layer like ``layer`` with ``n`` experts (top-k clamped to n)."""
    r = layer.config.router

    def build(n: int) -> MoELayer:
        router = dataclasses.replace(r, num_experts=n, top_k=min(r.top_k, n))
        return MoELayer(dataclasses.replace(layer.config, router=router), layer.dispatcher)

    return build


def check_prunable(layer: MoELayer, where: str = "layer") -> None:
    """Raise ValueError unless ``layer`` uses dropless-or-capacity token-choice routing
    without group limits (expert choice and USMoE select over tokens, group-limited routing
    needs equal groups, so removing experts would change their rules) and every per-expert
    tensor of it can be cut (its bank kind has ``select_experts``; the rest of the layer has
    the shapes :func:`~moelab.core.experts.select.expert_layout` expects). Cheap (meta
    tensors only): call it before calibrating."""
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
    check_selectable(layer.experts, where, "pruning")
    try:
        expert_layout(layer, r.num_experts, _builder(layer), skip="experts")
    except InvalidValueError as e:
        raise InvalidValueError(f"pruning: {where} cannot lose experts ({e})") from None


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
    index = torch.tensor(idx)
    new = take_experts(layer, index, E, _builder(layer), skip="experts")
    new.experts = layer.experts.select_experts(index)
    return new.train(layer.training)


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
