"""llama.cpp's block quantizers for the GGUF export, bit for bit as ``llama-quantize`` writes
them without an importance matrix (ggml/src/ggml-quants.c's ``quantize_row_*_ref``, as vendored
by llama-cpp-python 0.3.36).

:func:`quantize_ggml` is the entry point: F32/F16/BF16/Q8_0 straight from ``gguf.quants``;
Q4_0/Q4_1/Q5_0/Q5_1 from ``gguf.quants`` with the sign of a zero fp16 header fixed (below);
Q4_K from :func:`quantize_q4_k`, a numpy port (the ``gguf`` package only dequantizes Q4_K).

gguf-py's 32-block quantizers do the C's float32 arithmetic in the C's order, but pick block
extremes with numpy's ``min``/``max``/``argmax``, which may return either zero when several
``±0.0`` tie; the C keeps the first one met (``v < min``, ``v > max``; Q4_0/Q5_0 start from
``max = +0`` and move only on a strictly larger ``|v|``). The values are equal, only the sign bit
of ``d`` or ``m`` can differ, in blocks whose extreme is a zero: weights masked by a
multiplication (``-x · 0 = -0.0``) are the common case. :func:`quantize_ggml` rewrites those
headers from the C's choice, so the bytes match; the 4/5-bit levels do not depend on it.

Q4_K (:func:`quantize_q4_k`, ``quantize_row_q4_K_ref``): each row of 256·k weights is cut into
super-blocks of 256, each into 8 sub-blocks of 32:

1. per sub-block, weights ``w_l = sqrt(Σx²/32) + |x_l|`` and ``make_qkx2_quants(32, 15, x, w,
   rmin=-1, rdelta=0.1, nstep=20, use_mad=false)``: a scale and a min (``x ≈ scale·L - min``,
   ``L`` in 0..15) first from the sub-block's range, then the best of 21 weighted
   least-squares refits on the grids ``iscale = (15 - 1 + 0.1·is)/(max - min)``;
2. the 8 scales and 8 mins quantized to 6 bits against their maxima (``d = max_scale/63``,
   ``dmin = max_min/63``, stored as fp16) and packed into 12 bytes as ``get_scale_min_k4``
   reads them;
3. every weight requantized against the stored scales: ``L = nearest_int((x + dmin·m)/(d·sc))``
   clamped to 0..15, two per byte (weights ``l`` and ``l+32`` of each 64 share a byte).

Block layout (144 bytes): ``d`` fp16, ``dmin`` fp16, ``scales[12]``, ``qs[128]``.

Bit-exactness: every float operation is float32 in C's order (the sums run element by element,
never numpy's pairwise sums), ``nearest_int`` is ggml's magic-number rounding, the fp16
conversions round to nearest even as ``ggml_compute_fp32_to_fp16``. ggml-quants.c is in
``ggml-base``, which ggml builds without ``-march`` flags: on x86-64 there is no FMA to
contract ``a*b + c`` into, so the C rounds every product [C]; a build whose baseline has FMA and
a compiler that contracts (e.g. aarch64 GCC) may differ in the last bit of a sum and so,
rarely, in a block [I]. The tests compare against scalar transcriptions of the C and, where
llama-cpp-python is installed, against the bytes ``llama_model_quantize`` writes; once, by
hand, against ggml-quants.c compiled with ggml-base's flags (``gcc -O3 -DNDEBUG -std=gnu11``,
from llama-cpp-python's compile_commands.json): identical bytes on 18 000 Q4_K super-blocks
and 144 000 blocks of each 32-block type (Gaussian, 9 decades of scale, heavy-tailed, sparse
with ``-0.0``, ReLU-like, rounding ties); and llama-cpp-python 0.3.36's
``llama_model_quantize`` wrote the same tensors as moelab's export at all five types [measured].
"""

from __future__ import annotations

import numpy as np

from moelab.errors import InvalidValueError, MissingDependencyError

QK_K = 256
"""Weights per Q4_K super-block."""
Q4_K_BLOCK_BYTES = 144
"""Bytes per Q4_K super-block: fp16 d, fp16 dmin, 12 bytes of scales, 128 of 4-bit weights."""
_CHUNK = 1 << 14  # super-blocks quantized at once: bounds the temporaries (~30 MB)
_F = np.float32


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: add 1.5·2²³ in float32 and read the low mantissa bits (round half
    to even for ``|v| <= 4194303``), as int32."""
    bits = (v.astype(_F) + _F(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """``Σ terms[..., i]`` added left to right in float32, as a C loop does."""
    acc = np.zeros(terms.shape[:-1], dtype=_F)
    for i in range(terms.shape[-1]):
        acc = acc + terms[..., i]
    return acc


def make_qkx2_quants(
    x: np.ndarray,
    weights: np.ndarray,
    nmax: int = 15,
    rmin: float = -1.0,
    rdelta: float = 0.1,
    nstep: int = 20,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` (with ``use_mad = false``) over many groups at once.

    Args:
        x, weights: float32 ``[B, n]``: ``B`` groups of ``n`` values and their error weights.
        nmax: the largest level; rmin, rdelta, nstep: the refit grids (Q4_K: 15, -1, 0.1, 20).
    Returns:
        ``(scale [B] float32, the_min [B] float32, L [B, n] uint8)`` with
        ``x ≈ scale·L - the_min``; ``scale = 0`` and ``L = 0`` for a constant group.
    """
    x = x.astype(_F, copy=False)
    w = weights.astype(_F, copy=False)
    mn, mx = x[:, 0].copy(), x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, x.shape[1]):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    mn = np.where(mn > 0, _F(0), mn)
    flat = mx == mn  # a constant group returns before dividing: its results are set below
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = _F(nmax) / (mx - mn)
        scale = _F(1) / iscale
        L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(_F)
        diff = scale[:, None] * L + mn[:, None] - x
        best = _seq_sum(w * (diff * diff))
        for step in range(nstep + 1):
            # the C divides by, and shifts by, the *current* min: a better refit moves it
            iscale = (_F(rmin) + _F(rdelta) * _F(step) + _F(nmax)) / (mx - mn)
            Laux = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
            Laux = Laux.astype(_F)
            wl = w * Laux
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(wl * Laux)
            sum_xl = _seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            clamp = this_min > 0
            this_min = np.where(clamp, _F(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            diff = this_scale[:, None] * Laux + this_min[:, None] - x
            cur = _seq_sum(w * (diff * diff))
            better = (D > 0) & (cur < best) & ~flat
            L = np.where(better[:, None], Laux, L)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    scale = np.where(flat, _F(0), scale)
    L = np.where(flat[:, None], _F(0), L)
    return scale, -mn, L.astype(np.uint8)


def _quantize_superblocks(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_ref`` over ``x`` float32 ``[B, 256]`` → uint8 ``[B, 144]``."""
    B = x.shape[0]
    sub = x.reshape(B * 8, 32)
    av_x = np.sqrt(_seq_sum(sub * sub) / _F(32))
    scales, mins, L = make_qkx2_quants(sub, av_x[:, None] + np.abs(sub))
    scales, mins, L = scales.reshape(B, 8), mins.reshape(B, 8), L.reshape(B, 8, 32)
    # the maxima start at +0 and move only on a strictly larger value, as in the C
    max_scale, max_min = np.zeros(B, _F), np.zeros(B, _F)
    for j in range(8):
        max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
    # uint8_t ls = nearest_int(...): the int wraps to a byte, then MIN(63, ·)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.empty((B, 12), np.uint8)  # get_scale_min_k4's layout
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d16 = (max_scale / _F(63)).astype(np.float16)
    dmin16 = (max_min / _F(63)).astype(np.float16)
    d = d16.astype(_F)[:, None] * ls.astype(_F)  # [B, 8]
    dm = dmin16.astype(_F)[:, None] * lm.astype(_F)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((x.reshape(B, 8, 32) + dm[..., None]) / d[..., None]), 0, 15)
    # a sub-block whose stored scale is 0 keeps make_qkx2_quants' levels (`if (!d) continue;`)
    L = np.where((d == 0)[..., None], L, requant).astype(np.uint8).reshape(B, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(B, 128)
    return np.concatenate(
        [d16.view(np.uint8).reshape(B, 2), dmin16.view(np.uint8).reshape(B, 2), packed, qs],
        axis=1,
    )


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Quantize ``x`` to llama.cpp's Q4_K along its last axis, bit-exact with
    ``quantize_row_q4_K_ref`` (see the module docstring).

    Args:
        x: float array ``[..., n]`` (converted to float32), ``n`` a multiple of 256.
    Returns:
        uint8 ``[..., n // 256 * 144]``: the rows' super-blocks, as ``gguf.quants.quantize``
        returns packed types (``GGUFWriter.add_tensor(..., raw_dtype=Q4_K)`` takes it).
    Raises:
        InvalidValueError: the last axis is not a multiple of 256.
    """
    x = np.ascontiguousarray(x, dtype=_F)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise InvalidValueError(
            f"x: Q4_K needs rows of a multiple of {QK_K} values, got shape {x.shape}"
        )
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], Q4_K_BLOCK_BYTES), np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK):
        out[s : s + _CHUNK] = _quantize_superblocks(blocks[s : s + _CHUNK])
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * Q4_K_BLOCK_BYTES)


# the 32-block types whose fp16 header gguf-py may write with the other zero's sign:
# (has a min, levels: d = max/-levels or (max - min)/levels)
_LEGACY = {"Q4_0": (False, 8), "Q5_0": (False, 16), "Q4_1": (True, 15), "Q5_1": (True, 31)}


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_ggml(x: np.ndarray, type_name: str) -> np.ndarray:
    """``x`` in ggml type ``type_name`` along its last axis, as ``llama-quantize`` writes it.

    Args:
        x: float array ``[..., n]`` (converted to float32), ``n`` a multiple of the type's block.
        type_name: a ``gguf.GGMLQuantizationType`` name: ``F32``, ``F16``, ``BF16``, ``Q8_0``,
            ``Q5_1``, ``Q5_0``, ``Q4_1``, ``Q4_0`` or ``Q4_K``.
    Returns:
        float32/float16 ``[..., n]`` or the packed blocks, uint8 ``[..., n / block · bytes]``
        (what ``GGUFWriter.add_tensor(..., raw_dtype=...)`` takes).
    Raises:
        InvalidValueError: rows not a whole number of blocks; MissingDependencyError: no
            ``gguf`` package.
    """
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without gguf
        raise MissingDependencyError(
            "GGUF quantization needs the 'gguf' package: pip install gguf"
        ) from e
    x = np.ascontiguousarray(x, dtype=_F)
    if type_name == "Q4_K":
        return quantize_q4_k(x)
    qtype = gguf.GGMLQuantizationType[type_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if x.ndim == 0 or x.shape[-1] % block:
        raise InvalidValueError(
            f"x: {type_name} needs rows of a multiple of {block} values, got shape {x.shape}"
        )
    out = gguf.quants.quantize(x, qtype)
    if type_name not in _LEGACY:
        return out
    has_min, levels = _LEGACY[type_name]
    blocks = x.reshape(-1, 32)
    rows = np.arange(len(blocks))
    heads = out.reshape(len(blocks), -1)
    if has_min:  # the first minimum / maximum met, as `if (v < min)` / `if (v > max)`
        mn = blocks[rows, blocks.argmin(1)]
        mx = blocks[rows, blocks.argmax(1)]
        heads[:, 0:2] = _fp16_bytes((mx - mn) / _F(levels))
        heads[:, 2:4] = _fp16_bytes(mn)
    else:  # the first largest |v|, or the initial +0 when every |v| is 0
        i = np.abs(blocks).argmax(1)
        mx = np.where(blocks[rows, i] != 0, blocks[rows, i], _F(0))
        heads[:, 0:2] = _fp16_bytes(mx / _F(-levels))
    return heads.reshape(out.shape)
