"""Upcycle a BERT feed-forward network into an MoE layer that grows one expert at a time.

A BERT FFN, ``down(GELU_erf(up x))`` with biases (:class:`moelab.models.encoder.BertFFN`), is
exactly one expert of ``ExpertBank(activation="gelu", bias=True)``: ``w_up = upᵀ``,
``b_up = up.bias``, ``w_down = downᵀ``, ``b_down = down.bias``. :func:`moe_from_bert_ffn` builds
the first grown layer: expert 0 is the FFN (frozen, a separate segment), expert 1 a trainable
copy, router rows zero (so both get weight 1/2 and the layer equals the FFN at growth).
:func:`grow_copy` appends a trainable copy of expert 0 with a zero router row and freezes the
rest (:func:`moelab.core.growth.grow_experts`); :func:`drop_newest` undoes it (a candidate that
the selective search rejected). :func:`moe_forward` runs the layer, optionally with the newest
expert's router logit at −∞: the layer as it was before that expert was grown.

Routing: top-2 token choice with softmax after top-k [I] (``norm_topk_prob``: the two
selected weights sum to 1; with top-1 they would be constant 1 and the router would get no
gradient), no balance or z loss [I] (each expert belongs to a task; balancing would spread a
task's tokens over the others' experts).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.experts.segmented import SegmentedExpertBank
from moelab.core.growth import freeze_experts, grow_experts
from moelab.core.layer import MoELayer
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.encoder import BertFFN

TOP_K = 2


def expert_parameters(ffn: BertFFN) -> int:
    """Parameters of one expert copied from ``ffn``: ``2·D·F + F + D``."""
    return sum(p.numel() for p in ffn.parameters())


def moe_from_bert_ffn(ffn: BertFFN, top_k: int = TOP_K) -> MoELayer:
    """The FFN as a 2-expert MoE layer: expert 0 = ``ffn`` (frozen segment), expert 1 = a
    trainable copy, router ``[2, D]`` zeros (trainable). Same dtype as ``ffn``; ``ffn`` itself
    is not changed.

    Raises:
        InvalidTypeError: ``ffn`` is not a :class:`BertFFN`.
    """
    if not isinstance(ffn, BertFFN):
        raise InvalidTypeError(f"ffn: expected a BertFFN, got {type(ffn).__name__}")
    F_, D = ffn.up.weight.shape
    config = MoEConfig(
        router=RouterConfig(num_experts=2, top_k=top_k, norm_topk_prob=True),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=F_, activation="gelu", bias=True),
        losses=LossConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0),
    )
    layer = MoELayer(config).to(ffn.up.weight.dtype)
    bank = layer.experts
    with torch.no_grad():
        bank.w_up.copy_(ffn.up.weight.detach().T.expand(2, D, F_))
        bank.b_up.copy_(ffn.up.bias.detach().expand(2, F_))
        bank.w_down.copy_(ffn.down.weight.detach().T.expand(2, F_, D))
        bank.b_down.copy_(ffn.down.bias.detach().expand(2, D))
        layer.router.weight.zero_()
    freeze_experts(layer, [0])
    return layer


def grow_copy(layer: MoELayer) -> None:
    """Append a trainable copy of expert 0 (the original FFN) with a zero router row; every
    other expert is frozen (in place)."""
    grow_experts(layer, 1, init="copy", source=0)
    with torch.no_grad():
        layer.router.weight[-1].zero_()


def freeze_all(layer: MoELayer) -> None:
    """Freeze every expert of ``layer`` (the router stays trainable)."""
    freeze_experts(layer, range(layer.experts.num_experts))


def drop_newest(layer: MoELayer) -> None:
    """Remove the last expert and router row (in place); the other experts' parameters are
    kept as they are (same tensors).

    Raises:
        InvalidValueError: the layer would keep fewer than ``top_k`` experts, or its newest
            expert is not a segment of its own (it was not added by :func:`grow_copy`).
    """
    bank = layer.experts
    E = bank.num_experts
    if not isinstance(bank, SegmentedExpertBank) or bank.segments[-1].num_experts != 1:
        raise InvalidValueError("layer: its newest expert is not a separate grown segment")
    if layer.config.router.top_k > E - 1:
        raise InvalidValueError(f"layer: {E - 1} experts would be fewer than top_k")
    kept = SegmentedExpertBank(list(bank.segments)[:-1], list(bank.frozen)[:-1])
    kept.train(bank.training)
    layer.experts = kept
    router = layer.router
    w = router.weight
    router.weight = nn.Parameter(w.detach()[:-1].clone(), requires_grad=w.requires_grad)
    rc = dataclasses.replace(layer.config.router, num_experts=E - 1)
    router.config = rc
    layer.config = dataclasses.replace(layer.config, router=rc)
    layer.reset_loss_state()


def moe_forward(layer: MoELayer, x: Tensor, mask: Tensor | None, exclude_newest: bool) -> Tensor:
    """``layer(x, mask).hidden_states`` ``[..., D]``; with ``exclude_newest`` the newest
    expert's router logit is −∞ (never selected when ``E > top_k``; weight 0 when
    ``E == top_k``), which is the layer without that expert."""
    if not exclude_newest:
        return layer(x, mask).hidden_states
    x_TD = x.reshape(-1, x.shape[-1])
    logits = layer.router.logits(x_TD)
    newest = torch.arange(logits.shape[-1], device=logits.device) == logits.shape[-1] - 1
    logits = logits.masked_fill(newest, float("-inf"))
    token_mask = None if mask is None else mask.reshape(-1)
    return layer(x, mask, plan=layer.router.plan(logits, token_mask)).hidden_states
