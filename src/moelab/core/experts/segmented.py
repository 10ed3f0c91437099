"""An expert bank made of segments, each an :class:`ExpertBank` with its own parameters.

Continual-learning methods freeze old experts and train new ones (CaRE's growing adapter
bank, MoRAM's frozen ``old_lora_*`` atoms, CKA-guided selective upcycling; see
``shared/research/wave3-continual.md`` §1–2, §7.2). Freezing part of one stacked ``[E, ...]``
tensor by masking its gradient does not freeze it: AdamW's decoupled weight decay
(``θ ← θ − lr·λ·θ``) and its momentum keep moving the masked entries. Here the experts
``[0, E)`` are consecutive segments; a frozen segment's parameters are separate tensors with
``requires_grad=False`` that no optimizer is given (:func:`moelab.train.optim.build_optimizer`
refuses them by name, see :meth:`SegmentedExpertBank.frozen_parameters`).

The bank has the row interface :class:`moelab.core.layer.MoELayer` uses
(``forward(x_ND, counts, return_activations)``, ``num_experts``, ``config``, ``backend``,
``expert_output``), so a layer runs it unchanged. It is not an ``ExpertBank``: the layer's
fused dispatch-and-combine CPU path is skipped (each segment still runs the fused expert
kernel where it applies), and each call syncs once with the device to split the sorted rows
by segment. Code that needs the stacked tensors (``w_in``, ``w_down``, LoRA factors: pruning,
quantization, expert parallelism, width expansion) gets an ``AttributeError`` saying to call
:meth:`SegmentedExpertBank.consolidate` (or :func:`moelab.core.growth.consolidate_experts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from moelab.core.experts.bank import ExpertBank
from moelab.errors import InvalidTypeError, InvalidValueError

# attributes of ExpertBank that are (views of) the stacked [E, ...] tensors
_STACKED = ("w_in", "w_down", "w_gate_up", "w_up", "b_in", "b_down", "b_gate_up", "b_up")


def _empty_like_bank(bank: ExpertBank, num_experts: int) -> ExpertBank:
    """An ExpertBank of ``bank``'s config and backend whose parameters are still on the meta
    device (the caller registers real ones)."""
    with torch.device("meta"):
        return ExpertBank(bank.config, num_experts, bank.backend)


def slice_bank(bank: ExpertBank, start: int, stop: int, requires_grad: bool) -> ExpertBank:
    """Experts ``[start, stop)`` of ``bank`` as a new bank with its own parameters (copies,
    bit-identical values, same dtype and device). Every parameter of an ``ExpertBank`` is
    stacked over experts on dim 0; each keeps its own ``requires_grad`` and-ed with
    ``requires_grad``."""
    out = _empty_like_bank(bank, stop - start)
    for name, p in bank.named_parameters(recurse=False):
        t = p.detach()[start:stop].clone()
        out.register_parameter(
            name, nn.Parameter(t, requires_grad=p.requires_grad and requires_grad)
        )
    return out


def concat_banks(banks: Sequence[ExpertBank]) -> ExpertBank:
    """One bank holding the experts of ``banks`` in order (copies; every parameter trainable)."""
    out = _empty_like_bank(banks[0], sum(b.num_experts for b in banks))
    for name, _ in banks[0].named_parameters(recurse=False):
        t = torch.cat([getattr(b, name).detach() for b in banks])
        out.register_parameter(name, nn.Parameter(t))
    return out


class SegmentedExpertBank(nn.Module):
    """E experts held as consecutive segments of separate parameters.

    Expert ``e`` lives in the segment whose range ``[offsets[s], offsets[s] + sizes[s])``
    holds it; the router's expert indices are unchanged by segmenting.

    Args:
        segments: the banks, in expert order; all of one :class:`ExpertsConfig` and backend.
        frozen: one flag per segment; a frozen segment's parameters get
            ``requires_grad=False`` and must never reach an optimizer.
    Raises:
        InvalidTypeError: a segment is not an ``ExpertBank`` (quantized or offloaded banks
            cannot be segmented).
        InvalidValueError: no segments, ``frozen`` of another length, or segments of
            different configs or backends.
    """

    select_hint = "merge its segments into one bank first: moelab.core.growth.consolidate_experts"

    def __init__(self, segments: Sequence[ExpertBank], frozen: Sequence[bool]) -> None:
        super().__init__()
        if not segments:
            raise InvalidValueError("segments: need at least one expert bank")
        for s in segments:
            if type(s) is not ExpertBank:
                raise InvalidTypeError(
                    f"segments: expected ExpertBank, got {type(s).__name__} (quantized or "
                    "offloaded banks cannot grow or be frozen per expert)"
                )
        if len(frozen) != len(segments):
            raise InvalidValueError(
                f"frozen: need {len(segments)} flags (one per segment), got {len(frozen)}"
            )
        if any(
            s.config != segments[0].config or s.backend != segments[0].backend for s in segments
        ):
            raise InvalidValueError("segments: all must share one ExpertsConfig and backend")
        self.segments = nn.ModuleList(segments)
        self.frozen = tuple(bool(f) for f in frozen)
        for seg, f in zip(self.segments, self.frozen, strict=True):
            if f:
                seg.requires_grad_(False)

    @property
    def config(self):
        """The experts' :class:`~moelab.core.config.ExpertsConfig` (shared by all segments)."""
        return self.segments[0].config

    @property
    def num_experts(self) -> int:
        """E, the experts of all segments."""
        return sum(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Experts per segment, in order."""
        return tuple(s.num_experts for s in self.segments)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Index of every segment's first expert."""
        out, at = [], 0
        for n in self.sizes:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def backend(self) -> str:
        """The segments' grouped-matmul backend (see :class:`ExpertBank`)."""
        return self.segments[0].backend

    @backend.setter
    def backend(self, value: str) -> None:
        for s in self.segments:
            s.backend = value

    def expert_frozen(self) -> list[bool]:
        """``[E]`` flags: True for the experts of frozen segments."""
        return [f for f, n in zip(self.frozen, self.sizes, strict=True) for _ in range(n)]

    def frozen_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of frozen segments (they must keep ``requires_grad=False``)."""
        for seg, f in zip(self.segments, self.frozen, strict=True):
            if f:
                yield from seg.parameters()

    def locate(self, expert: int) -> tuple[int, int]:
        """``(segment index, index within the segment)`` of expert ``expert``.

        Raises:
            InvalidValueError: ``expert`` outside ``[0, E)``.
        """
        if not 0 <= expert < self.num_experts:
            raise InvalidValueError(f"expert: must be in [0, {self.num_experts}), got {expert}")
        for s, (start, n) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            if expert < start + n:
                return s, expert - start
        raise AssertionError("unreachable: offsets cover [0, E)")

    def forward(
        self, x_ND: Tensor, counts: Tensor, return_activations: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply expert e to its block of rows (see :meth:`ExpertBank.forward`).

        Args:
            x_ND: ``[N, D]`` rows sorted by expert.
            counts: ``[E]`` int64 rows per expert (sums to N).
            return_activations: also return the ``[N, F]`` intermediate activations.
        Returns:
            ``[N, D]`` outputs in the rows' order, or ``(outputs, activations)``.
        """
        if len(self.segments) == 1:
            return self.segments[0](x_ND, counts, return_activations=return_activations)
        counts_S = counts.split(self.sizes)
        rows = torch.stack([c.sum() for c in counts_S]).tolist()  # the one host sync
        outs, acts = [], []
        for seg, x, c in zip(self.segments, x_ND.split(rows), counts_S, strict=True):
            r = seg(x, c, return_activations=return_activations)
            if return_activations:
                outs.append(r[0])
                acts.append(r[1])
            else:
                outs.append(r)
        y = torch.cat(outs)
        return (y, torch.cat(acts)) if return_activations else y

    def expert_output(self, x_TD: Tensor, expert: int) -> Tensor:
        """Output of one expert on all tokens ``[T, D]`` (see :meth:`ExpertBank.expert_output`)."""
        s, e = self.locate(expert)
        return self.segments[s].expert_output(x_TD, e)

    def consolidate(self) -> ExpertBank:
        """One plain :class:`ExpertBank` with the same experts and outputs (copied, every
        parameter trainable: a stacked tensor cannot keep some experts frozen)."""
        out = concat_banks(list(self.segments))
        out.train(self.training)
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _STACKED or name.startswith("lora_"):
                raise AttributeError(
                    f"SegmentedExpertBank has no stacked {name!r}: its experts are separate "
                    "segments (grown or frozen); consolidate_experts(layer) gives a plain "
                    "ExpertBank"
                ) from None
            raise
