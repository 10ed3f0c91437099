"""Integer weight codes: bit packing and group-wise dequantization.

The storage side of quantized experts (the algorithms that choose the codes live in
:mod:`moelab.compress.quant`). A quantized matrix ``W [O, I]`` (rows = output channels,
columns = input features, the GPTQ orientation) is held as

- ``codes`` ``[.., O, I]`` integers in ``[0, 2^bits − 1]``, bit-packed (:func:`pack_codes`);
- ``scales`` ``[.., O, G]`` float16, one per output row and group of ``group_size`` input
  columns (``G = I / group_size``);
- ``zeros`` ``[.., O, G]`` integer zero points (asymmetric), or none (symmetric: the implicit
  zero point ``2^(bits−1)``, GPTQ's convention ``(maxq + 1) / 2``);
- ``g_idx`` ``[.., I]`` the group of every input column, only when GPTQ's act-order formed the
  groups in a permuted column order (the GPTQ/AutoGPTQ ``g_idx``); otherwise column ``j`` is in
  group ``j // group_size``.

``Ŵ[o, j] = scales[o, g(j)] · (codes[o, j] − zero[o, g(j)])``.

Packing: every 8 consecutive codes of ``bits`` bits fill exactly ``bits`` bytes
(little-endian: code ``i`` occupies bits ``bits·i .. bits·i + bits − 1`` of the 8·bits-bit word),
so any width from 1 to 8 bits packs without padding except at the very end (the code count is
padded to a multiple of 8 with zeros). ``bits = 8`` is the identity on bytes (no padding).
Scalar weight codes use the :data:`SUPPORTED_BITS`; vector-quantization indices
(:mod:`moelab.core.experts.vqformat`) use ``bits·d`` of them (e.g. 6 for 3 bits × 2 dimensions).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidTypeError, InvalidValueError

SUPPORTED_BITS = (2, 3, 4, 8)
CODE_WIDTHS = tuple(range(1, 9))
"""Bit widths :func:`pack_codes` packs (scalar codes and vector-quantization indices)."""


def check_bits(bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is one of :data:`SUPPORTED_BITS`."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise InvalidValueError(f"bits: must be one of {SUPPORTED_BITS}, got {bits!r}")


def check_width(bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is a packable code width (:data:`CODE_WIDTHS`)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in CODE_WIDTHS:
        raise InvalidValueError(f"bits: codes must be 1 to 8 bits wide, got {bits!r}")


def packed_size(numel: int, bits: int) -> int:
    """Bytes that :func:`pack_codes` uses for ``numel`` codes of ``bits`` bits."""
    check_width(bits)
    return numel if bits == 8 else -(-numel // 8) * bits


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes into a flat ``uint8`` tensor of :func:`packed_size` bytes.

    Args:
        codes: any shape, integer dtype, values in ``[0, 2^bits − 1]``.
        bits: 1 to 8.
    Raises:
        ValueError: unsupported ``bits`` or a code out of range.
        TypeError: ``codes`` is not an integer tensor.
    """
    check_width(bits)
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise InvalidTypeError(f"codes: expected an integer tensor, got {codes.dtype}")
    flat = codes.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise InvalidValueError(f"codes: values must be in [0, {(1 << bits) - 1}] for {bits} bits")
    if bits == 8:
        return flat.to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    words = (flat.view(-1, 8) << shifts).sum(1)  # < 2^(8·bits) <= 2^56 (bits <= 7): fits int64
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    return ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(
    packed: Tensor,
    bits: int,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.int64,
) -> Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [packed_size]`` → codes of ``shape`` in
    ``dtype`` (int64 by default; ``torch.uint8`` keeps dequantization at one byte per code).

    Raises:
        ValueError: the byte count does not match ``shape`` and ``bits``.
    """
    check_width(bits)
    numel = 1
    for s in shape:
        numel *= int(s)
    if (
        packed.dtype != torch.uint8
        or packed.dim() != 1
        or packed.numel() != packed_size(numel, bits)
    ):
        raise InvalidValueError(
            f"packed: expected uint8 [{packed_size(numel, bits)}] for {numel} codes of {bits} bits, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    if bits == 8:
        return packed.view(shape).to(dtype)
    if bits in (1, 2, 4):  # whole codes per byte, the lowest bits first: shifts within bytes
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:numel].view(shape).to(dtype)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.to(torch.int64).view(-1, bits) << byte_shifts).sum(1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].view(shape).to(dtype)


def column_groups(in_features: int, group_size: int, g_idx: Tensor | None, device=None) -> Tensor:
    """``[.., I]`` int64 group of every input column (``g_idx`` or ``j // group_size``)."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    return torch.arange(in_features, device=device) // group_size


def dequantize(
    codes: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bits: int,
    group_size: int,
    g_idx: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``Ŵ = scales[g] · (codes − zero[g])`` with groups along the last (input) axis.

    Args:
        codes: ``[.., O, I]`` integer codes (unpacked).
        scales: ``[.., O, G]`` float scales.
        zeros: ``[.., O, G]`` integer zero points, or None for symmetric (zero ``2^(bits−1)``).
        group_size: input columns per group (``I`` = per-channel).
        g_idx: ``[.., I]`` group of every column (act-order), or None.
        dtype: output float dtype.
    Returns:
        ``[.., O, I]`` in ``dtype``.
    """
    q = codes.to(dtype)
    if g_idx is None and codes.shape[-1] % group_size == 0:
        # groups are runs of group_size columns: broadcast the scales, no gathers
        shape = (*codes.shape[:-1], codes.shape[-1] // group_size, group_size)
        z = zeros.to(dtype).unsqueeze(-1) if zeros is not None else float(1 << (bits - 1))
        return (scales.to(dtype).unsqueeze(-1) * (q.view(shape) - z)).view(codes.shape)
    groups = column_groups(codes.shape[-1], group_size, g_idx, codes.device)
    if groups.dim() == 1:
        s = scales.to(dtype).index_select(-1, groups)
        z = zeros.index_select(-1, groups) if zeros is not None else None
    else:  # per-matrix g_idx [.., I]: gather along the group axis for every row
        idx = groups.unsqueeze(-2).expand(*codes.shape)
        s = scales.to(dtype).gather(-1, idx)
        z = zeros.gather(-1, idx) if zeros is not None else None
    q = q - (z.to(dtype) if z is not None else float(1 << (bits - 1)))
    return s * q
