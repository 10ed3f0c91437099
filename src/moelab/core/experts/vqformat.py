"""Vector-quantized weights (GPTVQ's format): shared codebooks of ``d``-dimensional centroids.

The storage side of :mod:`moelab.compress.quant.gptvq` (van Baalen et al., "GPTVQ: The
Blessing of Dimensionality for LLM Quantization", arXiv 2402.15319; layout as the authors'
``vq_quant.py``, Qualcomm-AI-research/gptvq). A matrix ``W [O, I]`` (rows = output channels)
is cut into vectors of ``d`` consecutive input columns and held as

- ``codes [.., O, I/d]``: the centroid index of every vector, in ``[0, K)`` with
  ``K = 2^(bits·d)`` (``bits`` per dimension; packed at ``bits·d`` bits,
  :func:`~moelab.core.experts.qformat.pack_codes`);
- ``codebook [.., O/rows, I/group_size, K, d]`` int8: one codebook per block of ``rows``
  output rows × ``group_size`` input columns (the code's ``rows_per_group`` ×
  ``columns_per_group``);
- ``scales [.., O/rows, I/group_size]`` float16: each codebook's symmetric 8-bit scale
  (the code's ``quantize_centroids(per_codebook=True)``: ``scale = max|c| / 127``).

``Ŵ[o, v·d + t] = scales[o // rows, v·d // group_size] ·
codebook[o // rows, v·d // group_size, codes[o, v], t]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidValueError

VQ_DIMS = (1, 2, 4)
"""Vector lengths ``d`` (the authors' runs use 1, 2 and 4)."""
CODEBOOK_BITS = 8
"""Bits of a stored centroid coordinate (the authors' ``--codebook-bitwidth 8``)."""
CODEBOOK_QMAX = (1 << (CODEBOOK_BITS - 1)) - 1


def check_vq_format(bits: int, vq_dim: int) -> None:
    """Raise ``ValueError`` unless ``vq_dim`` is one of :data:`VQ_DIMS` and ``bits`` (per
    dimension) is 2 to 4 with indices of at most 8 bits (``bits·vq_dim <= 8``)."""
    if vq_dim not in VQ_DIMS:
        raise InvalidValueError(f"vq_dim: must be one of {VQ_DIMS}, got {vq_dim!r}")
    if bits not in (2, 3, 4) or bits * vq_dim > 8:
        raise InvalidValueError(
            f"bits: vector quantization takes 2 to 4 bits per dimension with bits·vq_dim <= 8 "
            f"(indices of at most 8 bits), got {bits} × {vq_dim}"
        )


def num_centroids(bits: int, vq_dim: int) -> int:
    """``K = 2^(bits·d)`` centroids per codebook."""
    return 1 << (bits * vq_dim)


def vq_dequantize(
    codes: Tensor,
    codebook: Tensor,
    scales: Tensor,
    rows: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``[.., O, I]`` weights from centroid indices (module docstring's formula).

    Args:
        codes: ``[.., O, V]`` integer indices (``V = I / d``).
        codebook: ``[.., O/rows, I/group_size, K, d]`` int8 (or float) centroid codes.
        scales: ``[.., O/rows, I/group_size]`` per-codebook scales.
        rows, group_size: the codebook block.
        dtype: output float dtype.
    Raises:
        ValueError: the shapes disagree.
    """
    *lead, O, V = codes.shape  # noqa: E741
    *_, Gr, Gc, K, d = codebook.shape
    if Gr * rows != O or Gc * group_size != V * d or tuple(scales.shape[-2:]) != (Gr, Gc):
        raise InvalidValueError(
            f"codes {tuple(codes.shape)}, codebook {tuple(codebook.shape)}, scales "
            f"{tuple(scales.shape)} do not fit blocks of {rows} rows × {group_size} columns"
        )
    cb = codebook.to(dtype) * scales.to(dtype)[..., None, None]  # [.., Gr, Gc, K, d]
    cb = cb.repeat_interleave(rows, dim=-4).flatten(-3, -2)  # [.., O, Gc·K, d]
    col_group = torch.arange(V, device=codes.device) * d // group_size
    idx = (col_group * K + codes.long()).unsqueeze(-1).expand(*lead, O, V, d)
    return cb.gather(-2, idx).flatten(-2)
