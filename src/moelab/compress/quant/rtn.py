"""Round-to-nearest (RTN) group-wise quantization, and the scale/zero rule GPTQ shares.

Grid (GPTQ's ``Quantizer``, arXiv 2210.17323 code, as paraphrased in the research notes):
``maxq = 2^bits − 1``;

- asymmetric: the range ``[min(w_min, 0), max(w_max, 0)]`` of the group,
  ``scale = (x_max − x_min) / maxq``, integer ``zero = round(−x_min / scale)``;
- symmetric: ``x_max = max|w|``, ``scale = 2·x_max / maxq``, implicit ``zero = 2^(bits−1)``;
- an all-zero group gets the range ``[−1, 1]``;

``code = clamp(round(w / scale) + zero, 0, maxq)``, ``ŵ = scale · (code − zero)``, so every
weight inside the group's range is within half a step (``scale / 2``) of its ``ŵ``.

Choices of this project [I]: scales are rounded *up* to float16 (stored format) before the codes
are computed, so the stored scale is the one the codes were rounded against and the
half-step bound holds for the stored values; scales are clamped to at least ``2^-14`` (the
smallest normal float16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.experts.qformat import check_bits, dequantize
from moelab.errors import InvalidValueError

MIN_SCALE = 2.0**-14


@dataclass
class QuantizedTensor:
    """Codes and scales of ``W [.., O, I]`` quantized group-wise along the input axis.

    Attributes:
        codes: ``[.., O, I]`` int64 in ``[0, 2^bits − 1]``.
        scales: ``[.., O, G]`` float16.
        zeros: ``[.., O, G]`` int64 zero points, or None (symmetric).
        g_idx: ``[.., I]`` int64 group of every column (act-order) or None (``j // g``).
        bits, group_size: the grid.
    """

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None
    g_idx: Tensor | None
    bits: int
    group_size: int

    codebook = None  # scalar codes index no codebook (GPTVQ's VQTensor does)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[.., O, I]`` float weights ``scale · (code − zero)``."""
        return dequantize(
            self.codes, self.scales, self.zeros, self.bits, self.group_size, self.g_idx, dtype
        )


def round_scale_up(scale: Tensor) -> Tensor:
    """``scale`` (float32) → float16 no smaller than it (and at least :data:`MIN_SCALE`)."""
    s = (scale.float().clamp_min(MIN_SCALE) * (1 + 2.0**-10)).to(torch.float16)
    return s


def group_params(w: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """Scale and zero of each row of ``w [.., g]`` (one group per row).

    Returns:
        ``scale [..]`` float16 and ``zero [..]`` float32 (integer-valued).
    """
    maxq = (1 << bits) - 1
    w = w.float()
    x_min = w.amin(-1).clamp_max(0)
    x_max = w.amax(-1).clamp_min(0)
    if symmetric:
        x_max = torch.maximum(-x_min, x_max)
        x_min = -x_max
    empty = (x_max == 0) & (x_min == 0)
    x_min = torch.where(empty, -1.0, x_min)
    x_max = torch.where(empty, 1.0, x_max)
    scale = round_scale_up((x_max - x_min) / maxq)
    if symmetric:
        zero = torch.full_like(x_max, float(1 << (bits - 1)))
    else:
        zero = torch.round(-x_min / scale.float())
    return scale, zero


def quantize_values(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """``clamp(round(w / scale) + zero, 0, maxq)`` as float codes (broadcasting)."""
    maxq = (1 << bits) - 1
    return torch.clamp(torch.round(w / scale.float()) + zero, 0, maxq)


def quantize_rtn(W: Tensor, bits: int, group_size: int, symmetric: bool = False) -> QuantizedTensor:
    """Round-to-nearest quantization of ``W [.., O, I]`` with groups of ``group_size`` columns.

    Raises:
        ValueError: unsupported bits, or ``group_size`` does not divide ``I``.
    """
    check_bits(bits)
    I = W.shape[-1]  # noqa: E741
    if group_size < 1 or I % group_size:
        raise InvalidValueError(f"group_size: {group_size} does not divide the input width {I}")
    G = I // group_size
    Wg = W.float().reshape(*W.shape[:-1], G, group_size)
    scale, zero = group_params(Wg, bits, symmetric)
    codes = quantize_values(Wg, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    return QuantizedTensor(
        codes=codes.reshape(W.shape).long(),
        scales=scale,
        zeros=None if symmetric else zero.long(),
        g_idx=None,
        bits=bits,
        group_size=group_size,
    )
