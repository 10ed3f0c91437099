"""Grow an MoE layer's experts and freeze experts one by one, with the router kept trainable.

- :func:`freeze_experts` splits the layer's bank so the listed experts live in frozen
  segments (:class:`~moelab.core.experts.segmented.SegmentedExpertBank`). The layer's output
  is unchanged up to float rounding (≤ 1e-6: the same per-expert matmuls, but the plain
  bank's fused dispatch-and-combine CPU path is replaced by dispatch, experts, combine).
- :func:`grow_experts` freezes every existing expert and appends ``n_new`` trainable ones
  (CaRE's growing adapter bank, MoRAM's frozen old atoms, grow-by-one upcycling;
  ``shared/research/wave3-continual.md`` §1.1, §2.1, §5, read from the authors' code). The router's weight grows to ``E + n_new``
  rows and stays one trainable parameter: continual methods keep training the router (old
  rows included). What is preserved: the old experts' parameters and the old router rows
  are bit-identical, and every old expert computes exactly what it did; the layer's output is
  unchanged (≤ 1e-6) wherever the plan gives the new experts no pairs and the combine weights
  are renormalised over the selected experts (``norm_topk_prob``, or
  ``softmax_before_topk=False``). Otherwise the new router rows take softmax mass (or, with
  sigmoid scores, add selectable experts), so the output changes.
- :func:`consolidate_experts` turns a segmented bank back into one plain ``ExpertBank``
  (for saving, serving, pruning or quantizing; the freezing is dropped).

Each of them replaces parameters: build the optimizer after calling them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from moelab.core.dispatch import LocalDispatcher
from moelab.core.experts.bank import ExpertBank
from moelab.core.experts.segmented import SegmentedExpertBank, slice_bank
from moelab.core.layer import MoELayer
from moelab.errors import InvalidTypeError, InvalidValueError

GROW_INITS = ("random", "copy")


def _check_layer(layer: MoELayer) -> None:
    if not isinstance(layer, MoELayer):
        raise InvalidTypeError(f"layer: expected MoELayer, got {type(layer).__name__}")
    if type(layer.dispatcher) is not LocalDispatcher:
        raise InvalidValueError(
            f"layer: its dispatcher is {type(layer.dispatcher).__name__}; experts can grow or "
            "be frozen only with local dispatch (before expert-parallel sharding)"
        )
    if type(layer.experts) not in (ExpertBank, SegmentedExpertBank):
        raise InvalidTypeError(
            f"layer.experts: a {type(layer.experts).__name__} cannot grow or be frozen per "
            "expert (only ExpertBank and SegmentedExpertBank)"
        )


def _segments(layer: MoELayer) -> tuple[list[ExpertBank], list[bool]]:
    bank = layer.experts
    if isinstance(bank, SegmentedExpertBank):
        return list(bank.segments), list(bank.frozen)
    return [bank], [False]


def _expert_ids(ids: Iterable[int], E: int, what: str) -> list[int]:
    out = sorted({int(i) for i in ids})
    if not out:
        raise InvalidValueError(f"{what}: need at least one expert index")
    if out[0] < 0 or out[-1] >= E:
        raise InvalidValueError(f"{what}: expert indices must be in [0, {E}), got {out}")
    return out


def freeze_experts(layer: MoELayer, expert_ids: Iterable[int]) -> SegmentedExpertBank:
    """Freeze experts ``expert_ids`` of ``layer`` (in place): they move to frozen segments of
    separate parameters (``requires_grad=False``); the other experts, the router and the
    shared expert keep their ``requires_grad``. Experts frozen before stay frozen.

    Returns:
        The layer's new ``experts``.
    Raises:
        InvalidTypeError: not an MoELayer, or a quantized/offloaded bank.
        InvalidValueError: no index, an index outside ``[0, E)``, or a non-local dispatcher.
    """
    _check_layer(layer)
    E = layer.experts.num_experts
    ids = set(_expert_ids(expert_ids, E, "expert_ids"))
    segments, frozen = _segments(layer)
    new_segments, new_frozen, start = [], [], 0
    for seg, was in zip(segments, frozen, strict=True):
        flags = [was or (start + e) in ids for e in range(seg.num_experts)]
        if all(f == flags[0] for f in flags):  # the whole segment keeps one state: reuse it
            new_segments.append(seg)
            new_frozen.append(flags[0])
        else:  # split at every change of state
            a = 0
            for b in range(1, seg.num_experts + 1):
                if b == seg.num_experts or flags[b] != flags[a]:
                    new_segments.append(slice_bank(seg, a, b, requires_grad=not flags[a]))
                    new_frozen.append(flags[a])
                    a = b
        start += seg.num_experts
    bank = SegmentedExpertBank(new_segments, new_frozen)
    bank.train(layer.experts.training)
    layer.experts = bank
    return bank


def _new_experts(
    layer: MoELayer, n_new: int, init: str, source: list[int] | None
) -> tuple[ExpertBank, Tensor]:
    """The bank of new experts and their router rows ``[n_new, D]``."""
    old = layer.router.weight
    cfg = layer.config.experts
    ref = next(layer.experts.parameters())
    if init == "random":
        with torch.device(ref.device):
            bank = ExpertBank(cfg, n_new, layer.experts.backend).to(ref.dtype)
        rows = torch.empty(n_new, old.shape[1], dtype=old.dtype, device=old.device)
        nn.init.normal_(rows, std=cfg.init_std)  # as Router.__init__
        return bank, rows
    segments, _ = _segments(layer)
    parts = [
        slice_bank(segments[s], i, i + 1, requires_grad=True)
        for s, i in (_locate(segments, e) for e in source)
    ]
    with torch.device("meta"):
        bank = ExpertBank(cfg, n_new, layer.experts.backend)
    for name, _ in parts[0].named_parameters(recurse=False):
        mean = torch.stack([getattr(p, name).detach() for p in parts]).mean(0)
        bank.register_parameter(name, nn.Parameter(mean.expand(n_new, *mean.shape[1:]).clone()))
    rows = old.detach()[source].mean(0, keepdim=True).expand(n_new, -1).clone()
    return bank, rows


def _locate(segments: Sequence[ExpertBank], e: int) -> tuple[int, int]:
    for s, seg in enumerate(segments):
        if e < seg.num_experts:
            return s, e
        e -= seg.num_experts
    raise AssertionError("unreachable: e was checked to be in [0, E)")


def _grow_router(layer: MoELayer, rows: Tensor, init: str, source: list[int] | None) -> None:
    router = layer.router
    params = {n for n, _ in router.named_parameters()}
    buffers = {n for n, b in router.named_buffers() if b is not None}
    if params != {"weight"} or not buffers <= {"expert_bias"}:
        raise InvalidValueError(
            f"layer.router: a {type(router).__name__} with state {sorted(params | buffers)} "
            "cannot grow (only the weight and expert_bias are known to be per expert)"
        )
    n_new = rows.shape[0]
    E = router.weight.shape[0]
    rc = dataclasses.replace(layer.config.router, num_experts=E + n_new)  # validates E + n_new
    w = router.weight
    router.weight = nn.Parameter(torch.cat([w.detach(), rows]), requires_grad=w.requires_grad)
    bias = getattr(router, "expert_bias", None)
    if bias is not None:
        new = (
            bias[source].mean().expand(n_new)
            if init == "copy"
            else torch.zeros(n_new, dtype=bias.dtype, device=bias.device)
        )
        router.expert_bias = torch.cat([bias, new])
    router.config = rc
    layer.config = dataclasses.replace(layer.config, router=rc)


def grow_experts(
    layer: MoELayer,
    n_new: int,
    init: str = "random",
    source: int | Sequence[int] | None = None,
) -> SegmentedExpertBank:
    """Append ``n_new`` trainable experts to ``layer`` (in place) and freeze the old ones.

    The old experts keep their indices ``[0, E)`` and become frozen segments (their tensors
    are kept, not copied); the new experts ``[E, E + n_new)`` are one new trainable segment.
    The router weight becomes ``[E + n_new, D]`` (one parameter, trainable as before) and the
    layer's and router's configs get ``num_experts = E + n_new``. The model's config is not
    changed (see :func:`moelab.models.consolidate_model_experts`).

    Args:
        layer: the MoE layer.
        n_new: experts to add (>= 1).
        init: ``"random"``: the bank's own init (weights N(0, init_std), biases zero, LoRA
            B zero) and router rows N(0, init_std) as a new router's, expert bias 0;
            ``"copy"``: every new expert is the element-wise mean of the experts ``source``
            (a single index copies it; CaRE initialises a new expert to the mean of the
            existing ones except the newest), and so are its router row and expert bias.
        source: the expert index or indices ``"copy"`` reads (required for it, refused for
            ``"random"``).
    Returns:
        The layer's new ``experts``.
    Raises:
        InvalidTypeError: not an MoELayer, or a quantized/offloaded bank.
        InvalidValueError: ``n_new`` < 1, an unknown ``init``, a missing or out-of-range
            ``source``, a router config that ``E + n_new`` experts violate (e.g. ``n_group``),
            a router with other per-expert state, or a non-local dispatcher.
    """
    _check_layer(layer)
    if not isinstance(n_new, int) or isinstance(n_new, bool) or n_new < 1:
        raise InvalidValueError(f"n_new: must be an int >= 1, got {n_new!r}")
    if init not in GROW_INITS:
        raise InvalidValueError(f"init: must be one of {GROW_INITS}, got {init!r}")
    E = layer.experts.num_experts
    if init == "copy":
        if source is None:
            raise InvalidValueError("source: init='copy' needs the expert index or indices to copy")
        src = _expert_ids([source] if isinstance(source, int) else source, E, "source")
    elif source is not None:
        raise InvalidValueError(f"source: only used with init='copy', got {source!r}")
    else:
        src = None
    bank, rows = _new_experts(layer, n_new, init, src)
    _grow_router(layer, rows, init, src)
    segments, _ = _segments(layer)
    grown = SegmentedExpertBank([*segments, bank], [True] * len(segments) + [False])
    grown.train(layer.experts.training)
    layer.experts = grown
    layer.reset_loss_state()  # global-batch counts of E experts would not add to E + n_new
    return grown


def consolidate_experts(layer: MoELayer) -> ExpertBank:
    """Replace a segmented bank of ``layer`` by one plain :class:`ExpertBank` with the same
    experts (copies; all trainable). A plain bank is returned as it is.

    Raises:
        InvalidTypeError: not an MoELayer.
    """
    if not isinstance(layer, MoELayer):
        raise InvalidTypeError(f"layer: expected MoELayer, got {type(layer).__name__}")
    if isinstance(layer.experts, SegmentedExpertBank):
        layer.experts = layer.experts.consolidate()
    return layer.experts


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters that modules declare
    permanently frozen through a ``frozen_parameters()`` method: frozen expert segments and
    the old experts of grown adapters. They must keep ``requires_grad=False`` and never be
    given to an optimizer."""
    pinned = {
        id(p)
        for m in model.modules()
        if callable(getattr(m, "frozen_parameters", None))
        for p in m.frozen_parameters()
    }
    return {n for n, p in model.named_parameters() if id(p) in pinned}
