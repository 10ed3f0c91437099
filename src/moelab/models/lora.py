"""LoRA adapters on the stacked expert weights of a model: add, train only them, merge.

PEFT's LoRA wraps ``nn.Linear`` modules, which an expert bank of stacked ``[E, in, out]``
tensors does not have; here each routed expert e gets its own adapters on both projections,
``W_e + (α/r)·A_e B_e`` (:class:`moelab.core.experts.ExpertBank`, ``ExpertsConfig.lora_rank``).
Because the rank lives in the model config, a model with adapters saves and loads like any
other (:func:`moelab.models.save_model` / ``load_model``); :func:`merge_expert_lora` folds them
into the weights and gives back a plain model with identical outputs.

Our choices: adapters on both expert projections of every MoE layer (not attention, router,
shared expert or embeddings); A initialised as PEFT does (Kaiming-uniform), B zeros; with
:func:`freeze_all_but_lora` only the adapters train (``moelab train --lora-rank r``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moelab.core.experts import ExpertBank
from moelab.core.experts.segmented import SegmentedExpertBank
from moelab.core.growth import frozen_parameter_names
from moelab.errors import InvalidValueError
from moelab.models.transformer import MoETransformer


def _banks(model: MoETransformer) -> dict[str, ExpertBank]:
    for n, m in model.named_modules():
        if isinstance(m, SegmentedExpertBank):  # its banks are not the config's
            raise InvalidValueError(
                f"model: {n} holds grown or frozen expert segments; call "
                "moelab.models.consolidate_model_experts(model) first"
            )
    banks = {n: m for n, m in model.named_modules() if isinstance(m, ExpertBank)}
    if not banks:
        raise InvalidValueError("model: has no MoE layer whose experts could take adapters")
    return banks


def add_expert_lora(model: MoETransformer, rank: int, alpha: float = 16.0) -> MoETransformer:
    """A copy of ``model`` whose expert banks carry rank-``rank`` adapters (B = 0, so the
    outputs are unchanged). The input model is not modified.

    Raises:
        ValueError: rank < 1, alpha <= 0, a dense model, or adapters already present.
    """
    if not isinstance(rank, int) or rank < 1:
        raise InvalidValueError(f"rank: must be an int >= 1, got {rank!r}")
    if model.cfg.moe is not None and model.cfg.moe.experts.lora_rank:
        raise InvalidValueError(
            f"model: already has LoRA adapters of rank {model.cfg.moe.experts.lora_rank}"
        )
    _banks(model)
    cfg = copy.deepcopy(model.cfg)
    cfg.moe.experts.lora_rank = rank
    cfg.moe.experts.lora_alpha = float(alpha)
    cfg.moe.experts.__post_init__()
    p = next(model.parameters())
    with torch.device(p.device):
        new = MoETransformer(cfg).to(p.dtype)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any("lora_" not in k for k in missing):
        raise RuntimeError(f"add_expert_lora: state mismatch {missing} {unexpected}")
    for bank in _banks(new).values():
        bank.reset_lora()
    return new.train(model.training)


def freeze_all_but_lora(model: nn.Module) -> int:
    """Set ``requires_grad`` False on every parameter except the LoRA adapters (those of
    frozen expert segments stay frozen: :func:`moelab.core.growth.frozen_parameter_names`);
    returns the number of trainable parameters. Raises ValueError when the model has no
    adapters."""
    n = 0
    pinned = frozen_parameter_names(model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name.rsplit(".", 1)[-1] and name not in pinned)
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise InvalidValueError("model: has no LoRA adapters to train (set lora_rank)")
    return n


@torch.no_grad()
def merge_expert_lora(model: MoETransformer) -> MoETransformer:
    """A plain model (``lora_rank = 0``) with ``W ← W + (α/r)·A@B`` in every expert bank; its
    outputs equal ``model``'s up to float rounding.

    Raises:
        ValueError: the model has no adapters.
    """
    if model.cfg.moe is None or not model.cfg.moe.experts.lora_rank:
        raise InvalidValueError("model: has no LoRA adapters to merge")
    state = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    for name, bank in _banks(model).items():
        state[f"{name}.{bank._in_name}"] = bank.merged_weight("in")
        state[f"{name}.w_down"] = bank.merged_weight("down")
    cfg = copy.deepcopy(model.cfg)
    cfg.moe.experts.lora_rank = 0
    p = next(model.parameters())
    with torch.device(p.device):
        merged = MoETransformer(cfg).to(p.dtype)
    merged.load_state_dict(state)
    return merged.train(model.training)
