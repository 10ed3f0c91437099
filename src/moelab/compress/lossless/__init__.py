"""Lossless expert compression (ZipMoE, ICML 2026, arXiv 2601.21198): bf16/fp32 bit-field split,
exponent chunks entropy-coded with zstd or ANS, sign-mantissa raw, and the expert store."""

from moelab.compress.lossless.bitfield import entropy_bits, merge, split
from moelab.compress.lossless.model_store import (
    OpenStore,
    StoreReport,
    compress_model,
    copy_run_files,
    decompress_model,
    open_store,
)
from moelab.compress.lossless.store import ExpertPack, StoreError
from moelab.compress.lossless.tensor_codec import decode_tensor, encode_tensor, round_trip

__all__ = [
    "ExpertPack",
    "OpenStore",
    "StoreError",
    "StoreReport",
    "compress_model",
    "copy_run_files",
    "decode_tensor",
    "decompress_model",
    "encode_tensor",
    "entropy_bits",
    "merge",
    "open_store",
    "round_trip",
    "split",
]
