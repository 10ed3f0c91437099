"""Keep a subset of a bank's experts: the one operation behind expert pruning (keep the chosen
experts of a layer) and expert parallelism (keep this rank's contiguous block).

What to cut is derived from the bank itself, never listed by hand: a bank kind builds an empty
twin of itself with ``n`` and with ``n + 1`` experts on the meta device (no memory), and every
tensor whose leading dimension follows the expert count is per expert and is cut with
``index_select``; a tensor whose shape does not change is shared by the experts and is copied
whole. So weights, biases, LoRA adapters and whatever a new bank kind adds are all cut, and
each new parameter keeps its ``requires_grad`` and the Python attributes set on the old one
(LoRA freezing must survive sharding). The result is an independent copy.

A bank kind that can lose experts says so by a ``select_experts(index)`` method (``ExpertBank``
has one); the others — the quantized bank, whose codes are bit-packed over all experts and
whose low-rank factors may be shared across a grid, and the offloaded bank, which reads a
store — are refused by :func:`check_selectable`, naming the layer and the bank kind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moelab.errors import InvalidValueError


def can_select(bank: nn.Module) -> bool:
    """True when ``bank`` can give a copy of a subset of its experts (``select_experts``)."""
    return callable(getattr(bank, "select_experts", None))


def check_selectable(bank: nn.Module, where: str, purpose: str) -> None:
    """Raise ValueError naming ``where`` and the bank's kind unless ``bank`` can lose experts.

    Args:
        bank: an expert bank.
        where: the layer's name, for the message.
        purpose: the option or job that needs it (``"--expert-parallel"``, ``"pruning"``).
    Raises:
        ValueError: the bank kind has no ``select_experts``.
    """
    if not can_select(bank):
        raise InvalidValueError(
            f"{purpose}: {where} holds a {type(bank).__name__}, whose experts cannot be split "
            "or removed (only full-precision expert banks can; quantize after pruning or "
            "sharding, not before)"
        )


def carry_over(new: Tensor, old: Tensor) -> Tensor:
    """``new`` as the same kind of tensor as ``old``: a Parameter keeps ``requires_grad`` and
    the Python attributes set on it."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
    return new


@torch.no_grad()
def take_experts(bank: nn.Module, index: Tensor, build: Callable[[int], nn.Module]) -> nn.Module:
    """A copy of ``bank`` with only the experts ``index``, in that order.

    Args:
        bank: the bank of E experts.
        index: ``[n]`` int64 expert indices in ``[0, E)`` (checked by the caller).
        build: ``build(m)`` makes an empty bank of this kind with ``m`` experts; it is called
            on the meta device twice (``n`` and ``n + 1``) to learn which tensors are per expert,
            then once for real with ``n``.
    Returns:
        The new bank, on ``bank``'s devices and dtypes, in ``bank``'s training mode.
    Raises:
        RuntimeError: a tensor of ``bank`` fits neither rule (an internal bug of the bank kind).
    """
    n = int(index.numel())
    with torch.device("meta"):
        new = build(n)
        shape_n1 = {k: t.shape for k, t in build(n + 1).state_dict(keep_vars=True).items()}
    shape_n = {k: t.shape for k, t in new.state_dict(keep_vars=True).items()}
    for full, old in [*bank.named_parameters(), *bank.named_buffers()]:
        mod_name, _, leaf = full.rpartition(".")
        owner = new.get_submodule(mod_name)
        if full not in shape_n:
            raise RuntimeError(f"select_experts: {full} has no counterpart in a fresh bank")
        per_expert = shape_n[full] != shape_n1[full]
        if per_expert:
            t = old.detach().index_select(0, index.to(old.device)).clone()
        else:
            t = old.detach().clone()
        if t.shape != shape_n[full]:
            raise RuntimeError(
                f"select_experts: {full} has shape {tuple(t.shape)}, expected "
                f"{tuple(shape_n[full])}"
            )
        if leaf in owner._parameters:
            owner._parameters[leaf] = carry_over(t, old)
        else:
            owner._buffers[leaf] = t
    leftover = [k for k, t in new.state_dict(keep_vars=True).items() if t.is_meta]
    if leftover:
        raise RuntimeError(f"select_experts: {leftover} were not copied from the bank")
    return new.train(bank.training)
