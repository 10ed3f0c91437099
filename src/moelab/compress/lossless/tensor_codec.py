"""Lossless coding of one bf16/fp32 tensor: exponent stream in independent entropy-coded chunks,
sign-mantissa bytes raw (ZipMoE, arXiv 2601.21198, §3; the authors' code cuts each tensor's
exponents into ``num_file_chunks = 5`` contiguous chunks so several threads can decode one
tensor).

An encoded tensor is a JSON-able *spec* plus byte *segments* (the exponent chunks, then the
sign-mantissa bytes) that the pack writer places in the pack file; the spec records every
segment's offset, size and CRC-32, and the SHA-256 of the tensor's bit patterns, which the
decoder checks (so a decode is either bit-exact or an error).

Layout ``"split"`` is the ZipMoE layout; layout ``"raw"`` stores the plain bit patterns
(the uncompressed baseline that naive offloading reads).
"""

from __future__ import annotations

import hashlib
import itertools
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from moelab.compress.lossless.bitfield import (
    ELEMENT_BYTES,
    SM_BYTES,
    bits_to_tensor,
    dtype_name,
    entropy_bits,
    merge,
    split,
    tensor_bits,
)
from moelab.compress.lossless.coders import CODECS, decode_chunk, encode_chunk, symbol_table
from moelab.errors import InvalidValueError

DEFAULT_CHUNKS = 5
"""Exponent chunks per tensor (the authors' ``num_file_chunks``)."""
CODEC_CHOICES = ("best", "zstd", "lz4", "lz4hc", "ans", "raw")

ReadFn = Callable[[int, int], bytes]
"""``read(offset, size) -> bytes``: a positioned read from the pack."""


class TensorDecodeError(InvalidValueError):
    """A tensor's stored bytes fail their checksum or do not decode."""


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of ``min(chunks, n)`` contiguous, near-equal chunks of ``n`` items."""
    c = min(chunks, n)
    edges = [(i * n) // c for i in range(c + 1)] if c else [0]
    return list(itertools.pairwise(edges))


@dataclass
class EncodedTensor:
    """An encoded tensor before it is placed in a pack.

    Attributes:
        spec: JSON-able description (dtype, shape, layout, codec, symbol table, chunk symbol
            counts, sha256 of the bit patterns, exponent entropy in bits/element).
        segments: byte strings in pack order: exponent chunks then sign-mantissa (``split``),
            or the bit patterns (``raw``).
        encode_s: seconds spent encoding.
    """

    spec: dict[str, Any]
    segments: list[bytes] = field(default_factory=list)
    encode_s: float = 0.0

    @property
    def stored_bytes(self) -> int:
        return sum(len(s) for s in self.segments)

    def place(self, offset: int) -> dict[str, Any]:
        """The spec with absolute ``offset``/``size``/``crc32`` for every segment, the segments
        being written consecutively from ``offset``."""
        refs = []
        for seg in self.segments:
            refs.append({"offset": offset, "size": len(seg), "crc32": zlib.crc32(seg)})
            offset += len(seg)
        spec = dict(self.spec)
        if spec["layout"] == "raw":
            spec["raw"] = refs[0]
        else:
            n_chunks = len(spec["chunk_symbols"])
            spec["chunks"] = refs[:n_chunks]
            spec["sm"] = refs[n_chunks]
        return spec


def _encode_exponents(
    codec: str, exp: np.ndarray, chunks: int
) -> tuple[str, list[bytes], list[int], tuple[np.ndarray, np.ndarray]]:
    table = symbol_table(exp)
    bounds = chunk_bounds(exp.shape[0], chunks)
    sizes = [b - a for a, b in bounds]
    if table[0].size <= 1:
        return "const", [b"" for _ in bounds], sizes, table
    tried = CODECS if codec == "best" else (codec,)
    encoded = [(c, [encode_chunk(c, exp[a:b], table) for a, b in bounds]) for c in tried]
    name, blobs = min(encoded, key=lambda cb: sum(map(len, cb[1])))
    return name, blobs, sizes, table


def encode_tensor(t: Tensor, codec: str = "best", chunks: int = DEFAULT_CHUNKS) -> EncodedTensor:
    """Encode a bf16 or fp32 tensor.

    Args:
        t: any shape, ``torch.bfloat16`` or ``torch.float32`` (CPU or not; copied to CPU).
        codec: ``"best"`` (the smaller of zstd and ans per tensor), ``"zstd"``, ``"lz4"``,
            ``"lz4hc"``, ``"ans"``, or ``"raw"`` (no split, plain bit patterns).
        chunks: exponent chunks per tensor (>= 1).
    Raises:
        TypeError: unsupported dtype.
        ValueError: unknown codec or chunks < 1.
    """
    if codec not in CODEC_CHOICES:
        raise InvalidValueError(f"codec: must be one of {', '.join(CODEC_CHOICES)}; got {codec!r}")
    if chunks < 1:
        raise InvalidValueError(f"chunks: must be >= 1, got {chunks}")
    dtype = dtype_name(t)
    start = time.perf_counter()
    bits = tensor_bits(t)
    spec: dict[str, Any] = {
        "dtype": dtype,
        "shape": list(t.shape),
        "numel": int(bits.shape[0]),
        "sha256": hashlib.sha256(bits.tobytes()).hexdigest(),
    }
    if codec == "raw":
        spec.update(layout="raw", codec="raw")
        return EncodedTensor(spec, [bits.tobytes()], time.perf_counter() - start)
    exp, sm = split(bits)
    name, blobs, sizes, (symbols, counts) = _encode_exponents(codec, exp, chunks)
    spec.update(
        layout="split",
        codec=name,
        symbols=symbols.tolist(),
        counts=counts.tolist(),
        chunk_symbols=sizes,
        entropy_bits=entropy_bits(exp),
    )
    return EncodedTensor(spec, [*blobs, sm.tobytes()], time.perf_counter() - start)


# ----------------------------------------------------------------------------- decoding
def read_segment(read: ReadFn, ref: dict[str, Any], what: str) -> bytes:
    """Read one segment and check its size and CRC-32 (:func:`check_segment`).

    Raises:
        TensorDecodeError: short read or checksum mismatch (``what`` names the segment).
    """
    return check_segment(read(ref["offset"], ref["size"]), ref, what)


def check_length(data: bytes, ref: dict[str, Any], what: str) -> None:
    """Raises :class:`TensorDecodeError` (``what`` names the segment) unless ``data`` has the
    size that ``ref`` records (a short read: the pack is truncated)."""
    if len(data) != ref["size"]:
        raise TensorDecodeError(
            f"{what}: truncated (read {len(data)} of {ref['size']} bytes at offset {ref['offset']})"
        )


def check_segment(data: bytes, ref: dict[str, Any], what: str) -> bytes:
    """``data`` if it has the size and CRC-32 that ``ref`` records.

    Raises:
        TensorDecodeError: short read or checksum mismatch (``what`` names the segment).
    """
    check_length(data, ref, what)
    if zlib.crc32(data) != ref["crc32"]:
        raise TensorDecodeError(f"{what}: checksum mismatch (corrupt data)")
    return data


def decode_exponent_chunk(spec: dict[str, Any], i: int, blob: bytes) -> np.ndarray:
    """Decode exponent chunk ``i`` of a ``split`` tensor from its bytes alone."""
    table = (np.asarray(spec["symbols"], dtype=np.uint8), np.asarray(spec["counts"], np.int64))
    try:
        return decode_chunk(spec["codec"], blob, spec["chunk_symbols"][i], table)
    except ValueError as e:
        raise TensorDecodeError(f"exponent chunk {i}: {e}") from e


def assemble(
    spec: dict[str, Any], exp: np.ndarray, sm: bytes | np.ndarray, verify: bool = True
) -> Tensor:
    """Recombine a ``split`` tensor's exponent and sign-mantissa bytes into the tensor.

    Raises:
        TensorDecodeError: the result's sha256 differs from the stored one (``verify``).
    """
    sm_arr = np.frombuffer(sm, dtype=np.uint8) if isinstance(sm, bytes | bytearray) else sm
    check_streams(spec, exp, sm_arr)
    return finish_tensor(spec, merge(exp, sm_arr, spec["dtype"]), verify)


def check_streams(spec: dict[str, Any], exp: np.ndarray, sm: np.ndarray) -> None:
    """Raises :class:`TensorDecodeError` unless the streams have the tensor's lengths."""
    if exp.shape[0] != spec["numel"] or sm.shape[0] != spec["numel"] * SM_BYTES[spec["dtype"]]:
        raise TensorDecodeError("exponent/sign-mantissa streams have the wrong length")


def merge_range(
    spec: dict[str, Any], bits: np.ndarray, exp: np.ndarray, sm: np.ndarray, a: int, b: int
) -> None:
    """Recombine elements ``[a, b)`` of a ``split`` tensor into ``bits[a:b]`` (pieces of one
    tensor can be merged on different threads)."""
    w = SM_BYTES[spec["dtype"]]
    merge(exp[a:b], sm[a * w : b * w], spec["dtype"], out=bits[a:b])


def empty_bits(spec: dict[str, Any]) -> np.ndarray:
    """An uninitialised ``[numel]`` array for the tensor's bit patterns."""
    return np.empty(spec["numel"], dtype=np.uint16 if spec["dtype"] == "bfloat16" else np.uint32)


def finish_tensor(spec: dict[str, Any], bits: np.ndarray, verify: bool) -> Tensor:
    """The tensor of ``bits``, after checking their sha256 (``verify``).

    Raises:
        TensorDecodeError: the sha256 differs from the stored one.
    """
    if verify and hashlib.sha256(bits.tobytes()).hexdigest() != spec["sha256"]:
        raise TensorDecodeError("sha256 of the decoded tensor does not match the stored one")
    return bits_to_tensor(bits, spec["dtype"], tuple(spec["shape"]))


def decode_raw(spec: dict[str, Any], blob: bytes, verify: bool = True) -> Tensor:
    """Decode a ``raw``-layout tensor from its bytes."""
    dt = np.uint16 if spec["dtype"] == "bfloat16" else np.uint32
    if len(blob) != spec["numel"] * ELEMENT_BYTES[spec["dtype"]]:
        raise TensorDecodeError("raw tensor bytes have the wrong length")
    return finish_tensor(spec, np.frombuffer(blob, dtype=dt).copy(), verify)


def decode_tensor(spec: dict[str, Any], read: ReadFn, verify: bool = True) -> Tensor:
    """Read and decode a placed tensor (serially).

    Args:
        spec: a placed spec (:meth:`EncodedTensor.place`).
        read: positioned read from the pack.
        verify: check the sha256 of the result.
    Raises:
        TensorDecodeError: truncated, corrupt, or not bit-exact.
    """
    if spec["layout"] == "raw":
        return decode_raw(spec, read_segment(read, spec["raw"], "raw bytes"), verify)
    exp = np.empty(spec["numel"], dtype=np.uint8)
    start = 0
    for i, ref in enumerate(spec["chunks"]):
        blob = read_segment(read, ref, f"exponent chunk {i}")
        part = decode_exponent_chunk(spec, i, blob)
        exp[start : start + part.shape[0]] = part
        start += part.shape[0]
    sm = read_segment(read, spec["sm"], "sign-mantissa bytes")
    return assemble(spec, exp, sm, verify)


def memory_read(buf: bytes) -> ReadFn:
    """A :data:`ReadFn` over an in-memory buffer (tests, round-trip checks)."""
    view = memoryview(buf)
    return lambda offset, size: bytes(view[offset : offset + size])


def round_trip(t: Tensor, codec: str = "best", chunks: int = DEFAULT_CHUNKS) -> Tensor:
    """Encode and decode ``t`` in memory (verifying sha256): the identity on bit patterns."""
    enc = encode_tensor(t, codec, chunks)
    spec = enc.place(0)
    return decode_tensor(spec, memory_read(b"".join(enc.segments)))
