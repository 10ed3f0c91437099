"""Decoders of block-diffusion MoE LMs: threshold decoding and TEAM (arXiv 2602.08404), and
their serving engine."""

from moelab.serve.diffusion.decode import (
    DECODERS,
    BlockDecoder,
    DecodeOptions,
    DecodeResult,
    diffusion_generate,
    sampling_picker,
)
from moelab.serve.diffusion.engine import DiffusionEngine
from moelab.serve.diffusion.stats import DecodeStats

__all__ = [
    "DECODERS",
    "BlockDecoder",
    "DecodeOptions",
    "DecodeResult",
    "DecodeStats",
    "DiffusionEngine",
    "diffusion_generate",
    "sampling_picker",
]
