"""Bit-exact round trips of the ZipMoE bit-field split and the chunked exponent coders."""

import hashlib
import math

import numpy as np
import pytest
import torch

from moelab.compress.lossless.bitfield import MERGE_BLOCK, entropy_bits, merge, split, tensor_bits
from moelab.compress.lossless.tensor_codec import (
    chunk_bounds,
    decode_exponent_chunk,
    empty_bits,
    encode_tensor,
    memory_read,
    merge_range,
    round_trip,
)

CODECS = ("best", "zstd", "ans", "raw")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(tensor_bits(a), tensor_bits(b))
    )


def special(dtype: torch.dtype) -> torch.Tensor:
    """Denormals, ±0, ±inf, NaNs with payloads, extremes."""
    if dtype == torch.bfloat16:
        bits = [0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF,
                0x7F7F, 0x0080, 0x3F80]  # fmt: skip
        return torch.tensor(np.array(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    bits = [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
            0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 0x3F800000]  # fmt: skip
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


@pytest.fixture(scope="module")
def trained_weights() -> torch.Tensor:
    """Expert weights of a tiny MoE after 20 AdamW steps on a repeated sentence."""
    from moelab.models import ModelConfig, MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=64, max_seq_len=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.tensor([list(b"the quick brown fox jumps over the lazy dog!")[:33]]) % 64
    for _ in range(20):
        out = model.loss(ids[:, :-1], ids[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return model.blocks[0].ffn.experts.w_down.detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_is_bit_exact(dtype, codec):
    torch.manual_seed(0)
    cases = [
        (torch.randn(257, 33) * 0.02).to(dtype),  # random, N not a multiple of the chunks
        torch.full((64, 8), 0.125, dtype=dtype),  # all equal: one exponent symbol
        special(dtype),  # denormals, signed zeros, infinities, NaN payloads
        torch.cat([(torch.randn(500) * 1e-30).to(dtype), special(dtype)]),  # mixed
        torch.zeros(0, dtype=dtype),  # empty
        torch.tensor(3.5, dtype=dtype),  # 0-d
    ]
    for t in cases:
        assert same_bits(round_trip(t, codec, chunks=5), t), (codec, t.shape)


def test_real_trained_tensor_round_trips(trained_weights):
    for codec in CODECS:
        for dtype in (torch.bfloat16, torch.float32):
            t = trained_weights.to(dtype)
            assert same_bits(round_trip(t, codec), t)


def test_split_layout_matches_the_bit_fields():
    # bf16 0xC0A1 = s 1, e 0x81, m 0x21 -> exponent 0x81, sign-mantissa 0x80 | 0x21
    exp, sm = split(np.array([0xC0A1], dtype=np.uint16))
    assert exp.tolist() == [0x81] and sm.tolist() == [0xA1]
    # fp32 0xBF812345 = s 1, e 0x7F, m 0x012345 -> sm 0x812345 little-endian
    exp, sm = split(np.array([0xBF812345], dtype=np.uint32))
    assert exp.tolist() == [0x7F] and sm.tolist() == [0x45, 0x23, 0x81]
    # every 16-bit pattern survives split + merge, also across merge blocks and a ragged last one
    allbits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(merge(*split(allbits), "bfloat16"), allbits)
    tiled = np.tile(allbits, 5)[:-7]
    assert tiled.size > 2 * MERGE_BLOCK and tiled.size % MERGE_BLOCK
    assert np.array_equal(merge(*split(tiled), "bfloat16"), tiled)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_merging_in_pieces_equals_merging_whole(dtype):
    """The scheduler recombines a tensor chunk by chunk on several threads, into slices of one
    array, in any order."""
    rng = np.random.default_rng(0)
    n = 1001
    bits = rng.integers(0, 1 << (16 if dtype == "bfloat16" else 32), n, dtype=np.uint64)
    bits = bits.astype(np.uint16 if dtype == "bfloat16" else np.uint32)
    exp, sm = split(bits)
    spec = {"dtype": dtype, "numel": n}
    out = empty_bits(spec)
    for a, b in reversed(chunk_bounds(n, 5)):
        merge_range(spec, out, exp, sm, a, b)
    assert out.dtype == bits.dtype and np.array_equal(out, bits)


def test_chunks_decode_independently():
    torch.manual_seed(1)
    t = (torch.randn(1000) * 0.05).to(torch.bfloat16)
    exp, _ = split(tensor_bits(t))
    for codec in ("zstd", "ans"):
        enc = encode_tensor(t, codec, chunks=4)
        spec = enc.place(0)
        pack = b"".join(enc.segments)
        read = memory_read(pack)
        bounds = chunk_bounds(1000, 4)
        # decode the chunks in reverse order, each from its own bytes only
        for i in reversed(range(4)):
            ref = spec["chunks"][i]
            alone = bytes(read(ref["offset"], ref["size"]))
            a, b = bounds[i]
            assert np.array_equal(decode_exponent_chunk(spec, i, alone), exp[a:b])


def test_entropy_and_bits_per_element():
    assert entropy_bits(np.array([1, 1, 2, 2], dtype=np.uint8)) == pytest.approx(1.0)
    assert entropy_bits(np.full(10, 7, dtype=np.uint8)) == 0.0
    symbols = np.array([0] * 50 + [1] * 25 + [2] * 25, dtype=np.uint8)
    assert entropy_bits(symbols) == pytest.approx(1.5)
    torch.manual_seed(0)
    t = (torch.randn(200_000) * 0.02).to(torch.bfloat16)
    enc = encode_tensor(t, "ans", chunks=5)
    n = t.numel()
    exp_bytes = enc.stored_bytes - n  # sign-mantissa is one raw byte per element
    h = enc.spec["entropy_bits"]
    # ANS reaches the order-0 entropy bound within 1 %; zstd level 1 within 20 %
    assert n * h / 8 <= exp_bytes <= 1.01 * n * h / 8
    z = encode_tensor(t, "zstd", chunks=5)
    assert z.stored_bytes - n <= 1.2 * n * h / 8
    assert enc.spec["sha256"] == hashlib.sha256(tensor_bits(t).tobytes()).hexdigest()
    assert math.isclose(
        encode_tensor(t, "best").stored_bytes, min(enc.stored_bytes, z.stored_bytes)
    )


def test_bad_inputs():
    with pytest.raises(TypeError, match="bfloat16 and float32"):
        encode_tensor(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="codec"):
        encode_tensor(torch.zeros(3), "lz5")
    with pytest.raises(ValueError, match="chunks"):
        encode_tensor(torch.zeros(3), chunks=0)
    enc = encode_tensor((torch.randn(100) * 0.1).to(torch.bfloat16), "zstd")
    spec = enc.place(0)
    data = bytearray(b"".join(enc.segments))
    data[spec["chunks"][0]["offset"]] ^= 0xFF
    from moelab.compress.lossless.tensor_codec import TensorDecodeError, decode_tensor

    with pytest.raises(TensorDecodeError, match="checksum"):
        decode_tensor(spec, memory_read(bytes(data)))


@pytest.mark.parametrize("codec", ["lz4", "lz4hc"])
def test_lz4_codecs_round_trip_every_bf16_pattern(codec):
    pytest.importorskip("lz4.block")
    every = torch.tensor(np.arange(65536, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    rng = np.random.default_rng(0)
    shuffled = every[torch.from_numpy(rng.permutation(65536))].reshape(256, 256)
    for t in (every, shuffled, special(torch.float32), torch.zeros(0, dtype=torch.bfloat16)):
        assert same_bits(round_trip(t, codec, chunks=3), t), (codec, t.shape)


def test_lz4hc_is_smaller_than_lz4_and_a_corrupt_chunk_is_an_error():
    pytest.importorskip("lz4.block")
    torch.manual_seed(2)
    t = (torch.randn(20000) * 0.02).to(torch.bfloat16)
    fast, hc = encode_tensor(t, "lz4", 3), encode_tensor(t, "lz4hc", 3)
    assert hc.spec["codec"] == "lz4hc" and len(hc.spec["chunk_symbols"]) == 3
    # the same block format: HC only searches harder for matches, so it is never larger
    assert sum(map(len, hc.segments[:3])) <= sum(map(len, fast.segments[:3]))
    spec = hc.place(0)
    blob = bytes(hc.segments[0])
    with pytest.raises(ValueError, match="lz4hc chunk does not decode"):
        decode_exponent_chunk(spec, 0, blob[: len(blob) // 2])
