"""Keep a subset of a bank's experts: the one operation behind expert pruning (keep the chosen
experts of a layer) and expert parallelism (keep this rank's contiguous block).

What to cut is derived from the bank (or layer) itself, never listed by hand: a module kind
builds empty twins of itself with ``E`` and ``E + 1`` experts on the meta device (no memory),
and every tensor whose dim 0 grows by one row per expert is per expert and is cut with
``index_select``; a tensor whose shape does not change is shared by the experts and is copied
whole; anything else is refused (:func:`expert_layout`, which prunability checks call before
any calibration). So weights, biases, LoRA adapters and whatever a new bank kind adds are all cut, and
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
        # a bank kind may say how to get a selectable bank back (``select_hint``)
        hint = getattr(
            bank,
            "select_hint",
            "only full-precision expert banks can; quantize after pruning or sharding, not before",
        )
        raise InvalidValueError(
            f"{purpose}: {where} holds a {type(bank).__name__}, whose experts cannot be split "
            f"or removed ({hint})"
        )


def carry_over(new: Tensor, old: Tensor) -> Tensor:
    """``new`` as the same kind of tensor as ``old``: a Parameter keeps ``requires_grad`` and
    the Python attributes set on it."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
    return new


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _skipped(name: str, skip: str | None) -> bool:
    return skip is not None and (name == skip or name.startswith(skip + "."))


def expert_layout(
    module: nn.Module,
    num_experts: int,
    build: Callable[[int], nn.Module],
    skip: str | None = None,
) -> dict[str, bool]:
    """Which tensors of ``module`` (``E = num_experts`` experts) are per expert: for every
    parameter and buffer name (those under the submodule ``skip`` left out), True when its
    dim 0 is the expert axis, False when the experts share it.

    Learned from twins built on the meta device (``build(E)`` and ``build(E + 1)``): a tensor is
    per expert when one more expert adds exactly one row to its dim 0 and changes nothing else;
    shared when its shape does not change.

    Raises:
        ValueError: a tensor the twin lacks or holds with another shape, a twin tensor the
            module lacks, or a tensor that grows in another way (it could not be cut), naming it.
    """
    with torch.device("meta"):
        a, b = _tensors(build(num_experts)), _tensors(build(num_experts + 1))
    layout = {}
    for name, t in _tensors(module).items():
        if _skipped(name, skip):
            continue
        if name not in a or a[name].shape != t.shape:
            want = tuple(a[name].shape) if name in a else "nothing"
            raise InvalidValueError(
                f"{name}: shape {tuple(t.shape)}, but a fresh {type(module).__name__} of "
                f"{num_experts} experts has {want}; its experts cannot be cut"
            )
        sa, sb = a[name].shape, b[name].shape
        if sa != sb and (len(sa) == 0 or sb[0] != sa[0] + 1 or sb[1:] != sa[1:]):
            raise InvalidValueError(
                f"{name}: grows from {tuple(sa)} to {tuple(sb)} with one more expert, not by "
                "one row of dim 0; its experts cannot be cut"
            )
        layout[name] = sa != sb
    lacking = [k for k in a if k not in layout and not _skipped(k, skip)]
    if lacking:
        raise InvalidValueError(
            f"{lacking[0]}: a fresh {type(module).__name__} has it, this one does not; its "
            "experts cannot be cut"
        )
    return layout


@torch.no_grad()
def take_experts(
    module: nn.Module,
    index: Tensor,
    num_experts: int,
    build: Callable[[int], nn.Module],
    skip: str | None = None,
) -> nn.Module:
    """A copy of ``module`` with only the experts ``index``, in that order.

    Args:
        module: a bank (or a layer) of ``num_experts`` experts.
        index: ``[n]`` int64 expert indices in ``[0, num_experts)`` (checked by the caller).
        build: ``build(m)`` makes an empty module of this kind with ``m`` experts (called on
            the meta device; see :func:`expert_layout`).
        skip: a submodule the caller replaces itself (e.g. a layer's bank, cut by the bank's
            own ``select_experts``); it is left on the meta device.
    Returns:
        The new module, on ``module``'s devices and dtypes, in its training mode.
    Raises:
        ValueError: see :func:`expert_layout`.
    """
    layout = expert_layout(module, num_experts, build, skip)
    with torch.device("meta"):
        new = build(int(index.numel()))
    for name, old in _tensors(module).items():
        if name not in layout:
            continue
        mod_name, _, leaf = name.rpartition(".")
        owner = new.get_submodule(mod_name)
        t = old.detach()
        t = (t.index_select(0, index.to(t.device)) if layout[name] else t).clone()
        if leaf in owner._parameters:
            owner._parameters[leaf] = carry_over(t, old)
        else:
            owner._buffers[leaf] = t
    return new.train(module.training)
