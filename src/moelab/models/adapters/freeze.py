"""Train only the parameters a list of name patterns selects."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from moelab.core.growth import frozen_parameter_names
from moelab.errors import InvalidValueError
from moelab.models.adapters.match import Pattern, check_patterns, describe, parameter_matches


def freeze_except(model: nn.Module, patterns: Sequence[Pattern]) -> int:
    """Set ``requires_grad=True`` on the parameters ``patterns`` select and False on every
    other one; returns the number of trainable parameter elements.

    Names follow :mod:`moelab.models.adapters.match`: a string is a run of whole dotted
    components, so on a :class:`moelab.models.MoETransformer` ``freeze_except(model,
    ["router"])`` trains exactly the routers' weights (``blocks.i.ffn.router.weight``; the
    expert bias is a buffer, updated outside the optimizer) and ``["lora_A", "lora_B"]``
    trains the LoRA adapters. Parameters that modules declare permanently frozen (frozen
    expert segments, the old experts of a grown MoE-LoRA layer:
    :func:`moelab.core.growth.frozen_parameter_names`) stay frozen even when selected.

    Raises:
        InvalidTypeError: bad ``patterns``.
        InvalidValueError: a pattern that selects no parameter, or nothing left to train.
    """
    pats = check_patterns(patterns, "patterns")
    named = list(model.named_parameters())
    for p in pats:
        if not any(parameter_matches(p, n) for n, _ in named):
            shown = ", ".join(n for n, _ in named[:4])
            raise InvalidValueError(
                f"patterns: {describe(p)} matches no parameter (parameters include {shown}, ...)"
            )
    pinned = frozen_parameter_names(model)
    train = [n not in pinned and any(parameter_matches(p, n) for p in pats) for n, _ in named]
    total = sum(param.numel() for (_, param), t in zip(named, train, strict=True) if t)
    if total == 0:
        raise InvalidValueError(
            f"patterns: every parameter {[describe(p) for p in pats]} selects is permanently frozen"
        )
    for (_, param), t in zip(named, train, strict=True):
        param.requires_grad_(t)
    return total
