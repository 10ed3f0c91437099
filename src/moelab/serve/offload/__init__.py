"""Offloaded MoE inference (ZipMoE, ICML 2026, arXiv 2601.21198): experts in a lossless store,
per-layer caches (full / sign-mantissa tiers, LRU/LFU/FIFO/token-LFU/Belady), the cache
planner, and a scheduler overlapping reads with decompression."""

from moelab.serve.offload.engine import OffloadConfig, OffloadEngine, OffloadStats
from moelab.serve.offload.load import load_offloaded, offload_engine

__all__ = ["OffloadConfig", "OffloadEngine", "OffloadStats", "load_offloaded", "offload_engine"]
