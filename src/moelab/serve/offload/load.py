"""``load_offloaded``: a model whose experts stay in a lossless store on disk.

The returned :class:`MoETransformer` holds only the dense weights (embeddings, attention,
norms, routers, shared experts) in memory; every MoE layer's expert bank is an
:class:`OffloadedExpertBank` served by one :class:`OffloadEngine` (caches, scheduler,
statistics), reachable as ``model.offload_engine``. Outputs are bit-identical to the model
in memory. It works with :func:`moelab.serve.generate.generate_ids`, ``moelab eval`` and the
server like any model (inference only).
"""

from __future__ import annotations

import os

import numpy as np

from moelab.compress.lossless.model_store import open_store, skeleton_model
from moelab.models.transformer import MoETransformer
from moelab.serve.offload import lookahead
from moelab.serve.offload.bank import OffloadedExpertBank
from moelab.serve.offload.engine import OffloadConfig, OffloadEngine


def load_offloaded(
    folder: str | os.PathLike[str],
    *,
    cache_mb: float,
    policy: str = "zipmoe",
    storage_mbps: float | None = None,
    storage_latency_ms: float = 0.0,
    uncached: bool = False,
    threads: int | None = None,
    prefetch: int = 0,
    predictor: str = "gate",
    verify: str = "first",
    check_pack: bool = False,
    trace: np.ndarray | None = None,
    future: list[list[int]] | None = None,
    planner: str = "authors",
    admission: str = "authors",
) -> MoETransformer:
    """Load a store written by ``moelab compress RUN --lossless --out DIR`` for offloaded
    inference.

    Args:
        folder: the store folder.
        cache_mb: expert cache budget in MiB, all layers together (>= one layer's top-k
            experts).
        policy: ``zipmoe`` (planned full/SM tiers, token-weighted LFU with admission),
            ``lru``, ``lfu``, ``fifo``, ``belady`` (needs ``future``), or ``none`` (no cache:
            every expert loaded on demand, the Accelerate-like baseline).
        storage_mbps: emulate storage of this bandwidth (MB/s, 10^6 B/s): a CPU-to-I/O
            ratio proxy (:mod:`moelab.compress.lossless.store`).
        storage_latency_ms: the emulated device's per-request latency.
        uncached: read from the disk itself, the pack's page cache dropped around every read
            (the NVMe-class regime on a machine with an NVMe disk).
        threads: decode threads (0 = serial loads; None = the cores torch's threads leave
            free, at least 1).
        prefetch: next-layer experts to prefetch (0 = off).
        predictor: ``gate`` (the next layer's router on the current hidden state) or
            ``history`` (routing frequencies, the ZipMoE authors' predictor).
        verify: sha256 check of decoded tensors: ``first``, ``always`` or ``off``.
        check_pack: CRC-check every segment of the pack before serving (one pass over the
            file), so that a damaged or foreign pack fails before any output. Off by default:
            every segment is CRC-checked when it is read anyway, and the pass reads the whole
            pack, warming the page cache (later "storage" reads then come from memory) and
            costing a full read at start-up.
        trace: routing counts ``[P, L, E]`` for the planner (default: the store's profile).
        future: per layer, recorded expert requests (``belady``).
        planner: ``zipmoe``'s split rule, ``authors`` or ``argmin``
            (:mod:`moelab.serve.offload.planner`).
        admission: ``zipmoe``'s admission rule, ``authors`` or ``hysteresis``
            (:mod:`moelab.serve.offload.tiers`).
    Returns:
        An eval-mode model; ``model.offload_engine`` is its :class:`OffloadEngine`.
    Raises:
        StoreError: missing, truncated, corrupt or foreign store (names the file/expert).
        ValueError: bad settings or a budget below one layer's top-k experts.
    """
    store = open_store(folder, storage_mbps, latency_ms=storage_latency_ms, uncached=uncached)
    if check_pack:
        store.pack.verify()
    engine = OffloadEngine(
        store,
        OffloadConfig(
            cache_mb=cache_mb, policy=policy, threads=threads, prefetch=prefetch,
            predictor=predictor, storage_mbps=storage_mbps, verify=verify, future=future,
            planner=planner, admission=admission,
        ),
        trace=trace,
    )  # fmt: skip

    def bank(li, layer):
        return OffloadedExpertBank(
            engine, li, layer.config.experts, layer.config.router.num_experts
        )

    model = skeleton_model(store, bank)
    model.offload_engine = engine
    if prefetch and predictor == "gate":
        lookahead.install(model, engine.hint, prefetch)
    return model


def offload_engine(model: MoETransformer) -> OffloadEngine | None:
    """The :class:`OffloadEngine` of a model from :func:`load_offloaded` (None otherwise)."""
    return getattr(model, "offload_engine", None)
