"""Index bookkeeping of a width expansion: which entries of each grown parameter are old, which
are new, where an old entry moves to, and which old entry a copy-initialised new entry copies.

An :class:`Axis` is one dimension that grows from ``old`` to ``new`` entries. A fused axis of
``blocks`` equal blocks (the expert bank's ``w_gate_up`` ``[.., 2F]``, gate block then up
block) grows block by block: old entries keep their place inside their block and the new ones
are appended at the end of each block. A :class:`ParamPlan` says, for one model parameter,
which axis (if any) each dimension has, which dimensions are inputs (contracted with the
activation), and what kind of tensor it is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

Interval = tuple[int, int]
Region = tuple[Interval, ...]


@dataclass(frozen=True)
class Axis:
    """A dimension growing from ``old`` to ``new`` entries in ``blocks`` equal blocks.

    Attributes:
        old, new: total sizes (multiples of ``blocks``).
        blocks: fused blocks that grow separately (2 for a ``[gate | up]`` axis).
        role: ``"hidden"`` (the residual width), ``"heads"`` (the attention width that grows
            with it) or ``"inner"`` (an expert's / dense FFN's inner width).
    """

    old: int
    new: int
    blocks: int = 1
    role: str = "hidden"

    @property
    def grows(self) -> bool:
        return self.new > self.old

    def _sizes(self) -> tuple[int, int]:
        return self.old // self.blocks, self.new // self.blocks

    def segments(self) -> list[tuple[int, int, int]]:
        """``(old_start, old_stop, new_start)``: the old entries' contiguous runs and where
        each run lands in the new axis."""
        o, n = self._sizes()
        return [(b * o, (b + 1) * o, b * n) for b in range(self.blocks)]

    def old_intervals(self) -> list[Interval]:
        """Where the old entries sit in the new axis."""
        o, n = self._sizes()
        return [(b * n, b * n + o) for b in range(self.blocks)]

    def new_intervals(self) -> list[Interval]:
        """Where the new entries sit in the new axis."""
        o, n = self._sizes()
        return [(b * n + o, (b + 1) * n) for b in range(self.blocks)]

    def old_to_new(self) -> Tensor:
        """``[old]`` int64: the new index of every old entry."""
        o, n = self._sizes()
        j = torch.arange(self.old)
        return (j // o) * n + j % o

    def source(self) -> Tensor:
        """``[new]`` int64: the old entry a copy-initialised entry copies (Net2Net's mapping
        ``g(j) = j mod old`` inside each block; old entries map to themselves)."""
        o, n = self._sizes()
        p = torch.arange(self.new)
        return (p // n) * o + (p % n) % o

    def counts(self) -> Tensor:
        """``[new]`` float64: how many new entries share each entry's source (the Net2Net
        divisor of the weights that read this axis)."""
        src = self.source()
        return torch.bincount(src, minlength=self.old).to(torch.float64)[src]


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter grows.

    Attributes:
        name: the parameter's name in ``model.named_parameters()``.
        axes: per dimension, the growing :class:`Axis` or None.
        in_dims: dimensions contracted with the layer input (their growth needs the RMS
            rescale ``c`` and, for copies, the Net2Net divisor).
        kind: ``"matrix"``, ``"embedding"`` (rows are looked up, nothing contracted),
            ``"norm"`` (RMSNorm gains) or ``"bias"``.
        per_expert: dimension 0 indexes experts (RMS and ``c`` are per expert).
        scale_with: for a bias, the weight whose ``c`` it shares.
    """

    name: str
    axes: tuple[Axis | None, ...]
    in_dims: tuple[int, ...] = ()
    kind: str = "matrix"
    per_expert: bool = False
    scale_with: str | None = None

    @property
    def grows(self) -> bool:
        return any(a is not None and a.grows for a in self.axes)

    @property
    def input_grows(self) -> bool:
        return any(self.axes[d] is not None and self.axes[d].grows for d in self.in_dims)

    def new_shape(self, old_shape: torch.Size) -> tuple[int, ...]:
        return tuple(n if a is None else a.new for n, a in zip(old_shape, self.axes, strict=True))

    def old_index(self, shape: torch.Size) -> tuple[Tensor, ...]:
        """Broadcast index tensors placing an old-shaped tensor into the new one."""
        idx = []
        for d, (n, a) in enumerate(zip(shape, self.axes, strict=True)):
            v = torch.arange(n) if a is None else a.old_to_new()
            idx.append(v.reshape([-1 if i == d else 1 for i in range(len(shape))]))
        return tuple(idx)

    def gather_copy(self, old: Tensor, power: int = 1) -> Tensor:
        """Copy (Net2Net / HyperCloning) expansion of ``old``: every new entry copies its
        source entry and is divided by ``counts^power`` along each growing input dimension
        (``power=2`` for second moments)."""
        t = old
        for d, a in enumerate(self.axes):
            if a is not None and a.grows:
                t = t.index_select(d, a.source())
        return t * self.copy_divisor(t.shape, t.dtype).pow(-power)

    def copy_divisor(self, new_shape, dtype) -> Tensor:
        """Product over growing input dims of :meth:`Axis.counts`, broadcast to ``new_shape``."""
        div = torch.ones((), dtype=torch.float64)
        for d in self.in_dims:
            a = self.axes[d]
            if a is not None and a.grows:
                div = div * a.counts().reshape([-1 if i == d else 1 for i in range(len(new_shape))])
        return div.to(dtype)

    def map_region(self, region: Region) -> list[tuple[Region, Region]]:
        """Split an old-coordinate region into pieces ``(old_subregion, new_region)``."""
        per_dim = []
        for (a0, b0), axis in zip(region, self.axes, strict=True):
            if axis is None:
                per_dim.append([((a0, b0), (a0, b0))])
                continue
            pieces = []
            for s, e, ns in axis.segments():
                lo, hi = max(a0, s), min(b0, e)
                if lo < hi:
                    pieces.append(((lo, hi), (ns + lo - s, ns + hi - s)))
            per_dim.append(pieces)
        return [
            (tuple(p[0] for p in combo), tuple(p[1] for p in combo))
            for combo in itertools.product(*per_dim)
        ]

    def new_regions(self, new_shape: tuple[int, ...]) -> list[Region]:
        """Disjoint rectangles (new coordinates) that together hold every new entry."""
        olds = [
            [(0, n)] if a is None else a.old_intervals()
            for n, a in zip(new_shape, self.axes, strict=True)
        ]
        out = []
        for d, a in enumerate(self.axes):
            if a is None or not a.grows:
                continue
            before = olds[:d]
            after = [[(0, n)] for n in new_shape[d + 1 :]]
            for combo in itertools.product(*before, a.new_intervals(), *after):
                out.append(tuple(combo))
        return out


def full_region(shape) -> Region:
    return tuple((0, n) for n in shape)
