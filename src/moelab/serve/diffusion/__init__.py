"""Decoders of block-diffusion MoE LMs: threshold decoding and TEAM (arXiv 2602.08404)."""

from moelab.serve.diffusion.decode import DECODERS, DecodeOptions, DecodeResult, diffusion_generate
from moelab.serve.diffusion.stats import DecodeStats

__all__ = ["DECODERS", "DecodeOptions", "DecodeResult", "DecodeStats", "diffusion_generate"]
