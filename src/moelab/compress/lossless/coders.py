"""Entropy coders for exponent chunks: ``zstd`` (``zstandard``), ``lz4`` and ``lz4hc`` (the
``lz4`` package's block format; LZ4HC level 9 is the codec of the ZipMoE authors' evaluation
scripts, ``evaluate.py --code_type LZ4HC``), ``ans`` (``constriction``'s range-ANS stack coder
with a per-tensor order-0 model), ``const`` (a single symbol) and ``raw``.

Every chunk is a self-contained stream: it decodes from its own bytes plus, for ``ans``, the
tensor's symbol table, so chunks can be decoded in parallel or alone.

Choices (this project's, not the paper's):
- ZipMoE's code uses general-purpose codecs only (ZSTD level 1 in ``utils/config.py``; LZ4HC
  with 3 chunks in its evaluation scripts). We offer ZSTD level 1, LZ4 (acceleration 1) and
  LZ4HC level 9, and add ANS, the entropy coder DFloat11-style schemes use in spirit, as
  the issue asks; ``best`` picks the smaller per tensor (ANS gets within a fraction of a percent
  of the order-0 entropy; ZSTD level 1 is ~10-15 % above it but decodes several times faster
  and releases the GIL, which the scheduler's threads need).
- ANS probabilities are the tensor's exact symbol frequencies, ``counts / N`` in float64,
  quantised by ``constriction.stream.model.Categorical(perfect=False)``; the counts are stored
  in the index, so the decoder rebuilds the identical model.
"""

from __future__ import annotations

import importlib

import numpy as np

from moelab.errors import InvalidValueError, MissingDependencyError

CODECS = ("zstd", "ans")
"""Exponent codecs tried by ``best``."""
ZSTD_LEVEL = 1
LZ4HC_LEVEL = 9
KNOWN = "zstd, lz4, lz4hc, ans, const, raw"


def _zstd():
    return _optional("zstandard")


def _lz4_block():
    return _optional("lz4.block")


def _constriction():
    return _optional("constriction")


def _optional(name: str):
    """The lossless extra's module ``name``.

    Raises:
        MissingDependencyError: it is not installed (says how to install it).
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingDependencyError(
            f"{name} is not installed: pip install 'moelab[lossless]'"
        ) from None


def symbol_table(exp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(symbols [S] uint8, counts [S] int64)``: the distinct byte values of ``exp`` and how
    often each occurs, ascending by symbol."""
    counts = np.bincount(exp, minlength=256)
    symbols = np.nonzero(counts)[0]
    return symbols.astype(np.uint8), counts[symbols].astype(np.int64)


def _ans_model(counts: np.ndarray):
    c = _constriction()
    probs = counts.astype(np.float64) / float(counts.sum())
    return c.stream.model.Categorical(probs, perfect=False)


def encode_chunk(codec: str, data: np.ndarray, table: tuple[np.ndarray, np.ndarray]) -> bytes:
    """Encode one ``uint8`` chunk.

    Args:
        codec: ``"zstd"``, ``"lz4"``, ``"lz4hc"``, ``"ans"``, ``"const"`` or ``"raw"``.
        table: the tensor's :func:`symbol_table` (used by ``ans``).
    """
    if codec == "raw":
        return data.tobytes()
    if codec == "const":
        return b""
    if codec == "zstd":
        return _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data.tobytes())
    if codec in ("lz4", "lz4hc"):
        hc = dict(mode="high_compression", compression=LZ4HC_LEVEL) if codec == "lz4hc" else {}
        return _lz4_block().compress(data.tobytes(), store_size=False, **hc)
    if codec == "ans":
        symbols, counts = table
        idx = np.searchsorted(symbols, data).astype(np.int32)
        coder = _constriction().stream.stack.AnsCoder()
        coder.encode_reverse(idx, _ans_model(counts))
        return coder.get_compressed().astype("<u4").tobytes()
    raise InvalidValueError(f"codec: must be one of {KNOWN}; got {codec!r}")


def decode_chunk(
    codec: str,
    blob: bytes | memoryview,
    n: int,
    table: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """Decode one chunk of ``n`` symbols to a ``uint8`` array.

    Raises:
        ValueError: the chunk does not decode to ``n`` symbols (corrupt data).
    """
    if codec == "raw":
        out = np.frombuffer(blob, dtype=np.uint8)
    elif codec == "const":
        out = np.full(n, table[0][0], dtype=np.uint8)
    elif codec == "zstd":
        try:
            out = np.frombuffer(
                _zstd().ZstdDecompressor().decompress(bytes(blob), max_output_size=n), np.uint8
            )
        except _zstd().ZstdError as e:
            raise InvalidValueError(f"zstd chunk does not decode ({e})") from e
    elif codec in ("lz4", "lz4hc"):  # one block format: lz4hc differs only when encoding
        lz4 = _lz4_block()
        try:
            out = np.frombuffer(lz4.decompress(blob, uncompressed_size=n), np.uint8)
        except lz4.LZ4BlockError as e:
            raise InvalidValueError(f"{codec} chunk does not decode ({e})") from e
    elif codec == "ans":
        symbols, counts = table
        words = np.frombuffer(blob, dtype="<u4").astype(np.uint32)
        try:
            idx = _constriction().stream.stack.AnsCoder(words).decode(_ans_model(counts), n)
        except Exception as e:  # constriction raises plain exceptions on bad input
            raise InvalidValueError(f"ans chunk does not decode ({e})") from e
        if idx.size and (idx.min() < 0 or idx.max() >= symbols.size):
            raise InvalidValueError("ans chunk decodes to symbols outside the table")
        out = symbols[idx]
    else:
        raise InvalidValueError(f"codec: must be one of {KNOWN}; got {codec!r}")
    if out.shape[0] != n:
        raise InvalidValueError(f"{codec} chunk decodes to {out.shape[0]} symbols, expected {n}")
    return out
