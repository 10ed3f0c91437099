"""llama.cpp's 4/5-bit block quantizers: moelab's numpy Q4_K and gguf-py's Q4_0/Q4_1/Q5_0/Q5_1
against scalar transcriptions of ggml-quants.c's ``quantize_row_*_ref`` (float32 scalars, C's
operation order), a hand-derived Q4_K block, and round trips through ``gguf.quants``."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.errors import InvalidValueError
from moelab.interop.gguf_quants import make_qkx2_quants, quantize_ggml, quantize_q4_k

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")

F = np.float32


def _nearest_int(v) -> int:
    """C's nearest_int: round half to even (exact for |v| < 2**22)."""
    return int(np.rint(F(v)))


def _fp16(v) -> tuple[int, int]:
    """The two little-endian bytes of GGML_FP32_TO_FP16(v)."""
    b = np.array([v], np.float32).astype(np.float16).view(np.uint8)
    return int(b[0]), int(b[1])


def _f16(v) -> F:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))."""
    return F(np.float16(v))


# ---------------------------------------------- scalar transcriptions of ggml-quants.c
def _ref_make_qkx2(x, w):
    """make_qkx2_quants(n, 15, x, w, ..., rmin=-1, rdelta=0.1, nstep=20, use_mad=false)."""
    nmax, rmin, rdelta, nstep = 15, F(-1), F(0.1), 20
    n = len(x)
    mn = mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), -mn, [0] * n
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    best = F(0)
    L = [0] * n
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        diff = scale * F(L[i]) + mn - x[i]
        best += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + F(nmax)) / (mx - mn)
        sum_l = sum_l2 = sum_xl = F(0)
        aux = [0] * n
        for i in range(n):
            lv = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
            aux[i] = lv
            sum_l += w[i] * F(lv)
            sum_l2 += w[i] * F(lv) * F(lv)
            sum_xl += w[i] * F(lv) * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur = F(0)
            for i in range(n):
                diff = this_scale * F(aux[i]) + this_min - x[i]
                cur += w[i] * (diff * diff)
            if cur < best:
                L, best, scale, mn = aux, cur, this_scale, this_min
    return scale, -mn, L


def _ref_q4_k(x: np.ndarray) -> bytes:
    """quantize_row_q4_K_ref for one super-block of 256 float32 values."""
    x = [F(v) for v in x]
    L, scales, mins = [0] * 256, [F(0)] * 8, [F(0)] * 8
    max_scale = max_min = F(0)
    for j in range(8):
        sub = x[32 * j : 32 * j + 32]
        sum_x2 = F(0)
        for v in sub:
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F(32))
        w = [av_x + abs(v) for v in sub]
        scales[j], mins[j], L[32 * j : 32 * j + 32] = _ref_make_qkx2(sub, w)
        max_scale = scales[j] if scales[j] > max_scale else max_scale
        max_min = mins[j] if mins[j] > max_min else max_min
    inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
    inv_min = F(63) / max_min if max_min > 0 else F(0)
    sc = [0] * 12
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            sc[j], sc[j + 4] = ls, lm
        else:
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            sc[j - 4] |= (ls >> 4) << 6
            sc[j] |= (lm >> 4) << 6
    d, dmin = _f16(max_scale / F(63)), _f16(max_min / F(63))
    for j in range(8):  # get_scale_min_k4
        if j < 4:
            s, m = sc[j] & 63, sc[j + 4] & 63
        else:
            s, m = (
                (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
                (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
            )
        dj = d * F(s)
        if not dj:
            continue
        dm = dmin * F(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(15, _nearest_int((x[32 * j + i] + dm) / dj)))
    qs = [L[c + i] | (L[c + i + 32] << 4) for c in range(0, 256, 64) for i in range(32)]
    return bytes([*_fp16(max_scale / F(63)), *_fp16(max_min / F(63)), *sc, *qs])


def _ref_32(x, name: str) -> bytes:
    """quantize_row_{q4_0,q4_1,q5_0,q5_1}_ref for one block of 32."""
    bits = int(name[1])
    top = (1 << bits) - 1
    if name.endswith("_1"):
        mn, mx = F(np.finfo(F).max), F(-np.finfo(F).max)
        for v in x:
            mn, mx = (v if v < mn else mn), (v if v > mx else mx)
        d = (mx - mn) / F(top)
        head, shift, add = [*_fp16(d), *_fp16(mn)], mn, F(0.5)
    else:
        amax = mx = F(0)
        for v in x:
            if amax < abs(v):
                amax, mx = abs(v), v
        d = mx / F(-(1 << (bits - 1)))
        head, shift, add = [*_fp16(d)], F(0), F((1 << (bits - 1)) + 0.5)
    idv = F(1) / d if d else F(0)
    q = [int((v - shift) * idv + add) for v in x]
    q = [v & 0xFF for v in q] if name == "Q5_1" else [min(top, v) for v in q]  # Q5_1: no MIN
    lo = [(q[j] & 0xF) | ((q[j + 16] & 0xF) << 4) for j in range(16)]
    if bits == 4:
        return bytes([*head, *lo])
    qh = sum(((q[j] & 0x10) >> 4) << j for j in range(32))
    return bytes([*head, *qh.to_bytes(4, "little"), *lo])


def _hard_blocks(n_blocks: int, size: int, seed: int) -> np.ndarray:
    """Blocks of ``size`` float32 values that exercise the corner cases: Gaussian at several
    scales, outliers, all-positive/all-negative, zeros, a constant block, a zero sub-block,
    values on a half-integer grid (rounding ties), fp16-subnormal scales, ``±0.0`` extremes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_blocks, size)).astype(F)
    x *= F(10.0) ** rng.uniform(-3, 1, (n_blocks, 1)).astype(F)
    x[0] = 0
    x[1] = 0.25
    x[2] = np.abs(x[2])
    x[3] = -np.abs(x[3])
    x[4, :32] = 0
    x[5, 7] = 40.0
    x[6] = np.round(rng.uniform(-8, 8, size) * 2).astype(F) / 2
    x[7] *= F(1e-6)
    x[8] = np.arange(size, dtype=F) % 16
    x[9, 100 % size] = -3.0
    keep = rng.random((3, size)) < 0.25  # masked weights: zeros of both signs
    x[10] = np.where(keep[0], -np.abs(x[10]), F(-0.0))
    x[11] = np.where(keep[1], np.abs(x[11]), F(-0.0))
    x[12] = np.where(keep[2], F(0.0), F(-0.0))
    x[12, 0] = -0.0
    return x


def test_q4_k_equals_the_c_reference_bit_for_bit():
    x = _hard_blocks(30, 256, seed=0)
    got = quantize_q4_k(x)
    assert got.shape == (30, 144) and got.dtype == np.uint8
    for b in range(len(x)):
        assert got[b].tobytes() == _ref_q4_k(x[b]), f"block {b}"


def test_make_qkx2_quants_moves_its_min_between_refits():
    """A group where a refit lowers the min: later grids are measured from the new min (the C
    reads the updated ``min``); the vectorised search matches the scalar one group by group."""
    x = _hard_blocks(64, 32, seed=3)
    w = np.sqrt((x * x).mean(1, keepdims=True)) + np.abs(x)
    scale, the_min, L = make_qkx2_quants(x, w.astype(F))
    moved = 0
    for g in range(len(x)):
        s, m, lv = _ref_make_qkx2(list(x[g]), list(w[g].astype(F)))
        assert (scale[g], the_min[g], L[g].tolist()) == (s, m, lv), g
        moved += bool(m != -min(F(0), x[g].min()))
    assert moved > 10  # most groups end on a refit min, not their range's


def test_q4_k_hand_checked_block():
    """Sub-blocks 0-3 hold 0..15 twice, 4-7 the same less 4: every sub-block is exactly
    L·1 - min with min 0 or 4, so the first fit has zero error and is kept: scales 1, mins
    0/4 → ls = 63 everywhere, lm = 0,0,0,0,63,63,63,63; d = fp16(1/63), dmin = fp16(4/63);
    requantized against d·63 = 0.99976 and dmin·63 = 3.999 the levels are l mod 16 again."""
    lv = np.arange(32) % 16
    x = np.concatenate([np.tile(lv, 4), np.tile(lv - 4, 4)]).astype(F)
    block = quantize_q4_k(x)
    assert block.shape == (144,)
    assert block[:2].view(np.float16)[0] == np.float16(1 / 63) == np.float16(0.015869140625)
    assert block[2:4].view(np.float16)[0] == np.float16(4 / 63) == np.float16(0.0634765625)
    assert block[4:16].tolist() == [255] * 4 + [192] * 4 + [255] * 4
    assert block[16:].tolist() == [17 * (i % 16) for i in range(32)] * 4
    back = gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_allclose(back, x, atol=0.004)


def test_q4_k_round_trip_through_gguf_dequantize():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 512)).astype(F)
    q = quantize_q4_k(x)
    assert q.shape == (6, 2 * 144)
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K)
    assert back.shape == x.shape
    rel = float(np.sqrt(((back - x) ** 2).mean() / (x**2).mean()))
    assert 0.04 < rel < 0.11, rel  # 4 bits over a 32-value range of ~4.5 sigma: ~0.08
    sub_err = np.abs(back - x).reshape(-1, 32).max(1)
    sub_range = np.ptp(x.reshape(-1, 32), axis=1)
    assert (sub_err <= sub_range / 15).all()  # within one level of every sub-block's grid


def test_partial_blocks_are_refused():
    with pytest.raises(InvalidValueError, match=r"^x: Q4_K needs rows of a multiple of 256"):
        quantize_ggml(np.zeros((2, 96), F), "Q4_K")
    with pytest.raises(InvalidValueError, match=r"^x: Q4_0 needs rows of a multiple of 32"):
        quantize_ggml(np.zeros((2, 40), F), "Q4_0")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_32_blocks_equal_the_c_reference(name):
    """gguf-py's quantizers with the zero-sign fix of quantize_ggml (blocks 10-12)."""
    x = _hard_blocks(40, 32, seed=2)
    got = quantize_ggml(x, name)
    assert got.shape == (40, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1])
    for b in range(len(x)):
        assert got[b].tobytes() == _ref_32(list(x[b]), name), f"{name} block {b}"
