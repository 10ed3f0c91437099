"""Options shared by ``moelab generate`` and ``moelab eval`` for offloaded experts
(``--offload --cache-mb N [--policy ...] [--storage-mbps ...]``) and the statistics table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from moelab.cli._app import Opt, err_console
from moelab.cli._common import load_run
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError

OffloadFlag = Annotated[
    bool, Opt("--offload", help="Serve experts from a lossless store (moelab compress --lossless).")
]
CacheMb = Annotated[
    float | None,
    Opt(help="With --offload: expert cache budget in MiB (all layers)."),
    Range(min=0, min_open=True),
]
Policy = Annotated[
    str, Opt(help="With --offload: cache policy zipmoe, lru, lfu, fifo or none (no cache).")
]
StorageMbps = Annotated[
    float | None,
    Opt(help="With --offload: emulate storage of this bandwidth (MB/s, at least 0.1)."),
    Range(min=0.1),  # slower would sleep for hours while the cache planner samples reads
]


def load_for_inference(
    run: Path, offload: bool, cache_mb: float | None, policy: str, storage_mbps: float | None
):
    """``(model, tokenizer)``: the run in memory, or with ``offload`` its store served through
    :func:`moelab.serve.offload.load_offloaded`.

    Raises:
        ValueError: offload options without ``--offload``, a store without it, ``--offload`` without
            ``--cache-mb``, or ``belady`` (it needs a recorded future; see the benchmark).
    """
    if not offload:
        if cache_mb is not None or storage_mbps is not None or policy != "zipmoe":
            raise InvalidValueError("--cache-mb, --policy and --storage-mbps need --offload")
        from moelab.compress.lossless.store import is_store

        if is_store(run):
            raise InvalidValueError(
                f"{run}: a lossless expert store; serve it with --offload --cache-mb N"
            )
        return load_run(run, edits=True)
    from moelab.data import load_tokenizer
    from moelab.serve.offload import load_offloaded

    if cache_mb is None:
        raise InvalidValueError("cache_mb: --offload needs --cache-mb N (MiB for the expert cache)")
    if policy not in ("zipmoe", "lru", "lfu", "fifo", "none"):
        raise InvalidValueError(f"policy: must be zipmoe, lru, lfu, fifo or none; got {policy!r}")
    # the CLI checks the whole pack first, so a damaged store fails before any output (the
    # library leaves it opt-in: segments are checked on read, and the pass warms the page cache)
    model = load_offloaded(
        run, cache_mb=cache_mb, policy=policy, storage_mbps=storage_mbps, check_pack=True
    )
    return model, load_tokenizer(run)


def report_offload(model, tokens: int, seconds: float) -> None:
    """Print the offload engine's statistics (stderr) after ``tokens`` tokens in ``seconds``."""
    from moelab.serve.offload import offload_engine

    engine = offload_engine(model)
    if engine is None:
        return
    s = engine.snapshot()
    plan = engine.plan
    tiers = (
        f"planned tiers: {plan.n_full} full + {plan.n_sm} sign-mantissa slots/layer"
        if plan is not None and plan.kind == "two_tier"
        else f"policy {engine.config.policy}"
    )
    req = max(s.requests, 1)
    err_console.print(
        f"[dim]offload: {tiers}; {s.requests} expert requests, hit rate full "
        f"{s.hits_full / req:.1%}, sign-mantissa {s.hits_sm / req:.1%}, miss "
        f"{s.misses / req:.1%}; read {s.bytes_read / 1e6:.1f} MB in {s.read_s:.2f} s, decode "
        f"{s.decode_s:.2f} s, waited {s.wait_s:.2f} s; "
        f"{1000 * seconds / max(tokens, 1):.1f} ms/token[/]"
    )
