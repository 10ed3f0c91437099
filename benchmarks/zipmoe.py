"""ZipMoE (ICML 2026, arXiv 2601.21198) on moelab models: lossless expert sizes and offloaded
decoding speed.

For every ``--run`` (cast to bf16):

1. **Sizes**: every expert tensor split into exponent and sign-mantissa bytes; the exponent
   stream coded with zstd (level 1, the authors' config default, 5 chunks), LZ4HC (level 9,
   the authors' evaluation codec, 3 chunks) and ANS (``constriction``, 5 chunks), against the
   order-0 entropy bound ``N·H/8``; totals as % of bf16.
2. **Decoding speed**: ``--prompts`` KJV prompts of ``--prompt-tokens`` tokens, each followed
   by ``--tokens`` greedy output tokens (batch 1); TTFT (prompt to first token, prefill
   included) and TPOT (seconds per output token after the first) separately; MB read, experts
   loaded and how often each tier served a request (full / SM / miss) over the decode steps;
   at expert-cache budgets ``--budgets`` (% of the expert bytes), in the storage ``--regimes``:
   - ``nvme``: real reads from this machine's disk with the page cache dropped around every
     read (``POSIX_FADV_DONTNEED``, readahead off): the NVMe-class regime of the paper, if
     the disk is NVMe-class (this VM's reads 1.0–1.5 GB/s);
   - ``capN``: an emulated device of N MB/s with ``--latency-ms`` per request over reads
     served from the page cache: a CPU-to-I/O ratio proxy (how much decode work a read's time
     pays for), not a model of a device;
   systems, all at the same budget:
   - *no cache*: uncompressed store, no expert cache, every expert read on demand on the
     forward thread (Accelerate / DeepSpeed-style offloading, the paper's baselines);
   - *LRU*: uncompressed store, an LRU per-expert cache, serial loads;
   - *frequency prefetch*: uncompressed store, LFU, the next layer's top-k most frequent
     experts (the ZipMoE authors' history predictor) prefetched on ``--threads`` threads (not
     MoE-Infinity's activation-matrix matching);
   - *ZipMoE zstd* / *ZipMoE LZ4HC*: the authors' planner (``CachePoolPlanningSimu``) and
     admission (``ProactiveDecision``), the Type-I/II scheduler on ``--threads`` threads;
   - *ZipMoE argmin*: zstd, this project's earlier argmin planner and hysteresis admission.
   Every configuration is run ``--repeats`` times, the configurations shuffled per round
   (interleaved, so background load hits all alike); mean ± sd over the rounds. Every
   offloaded generation is checked token for token against the in-memory one.
3. **Hit rates on the recorded decode trace** (simulation): LRU, LFU, FIFO and Belady's bound
   at the single-tier slot count of each budget.

Threads: torch runs ``--torch-threads`` intra-op threads (default 1) and the decode threads
default to the cores left (:func:`moelab.serve.offload.engine.free_cores`), so nothing is
oversubscribed. Stores are written under ``--work`` (reused when present). Decoded tensors
are not sha256-checked in the timed runs (``verify="off"``: the round trip was verified when
the store was written, and every segment's CRC-32 is still checked on every read).

Example (the issue's table, SmolLM2-MoE):
  python benchmarks/zipmoe.py --run runs/smollm2-moe --no-sizes --repeats 1 \\
      --regimes nvme cap300 --budgets 10 25 50 --prompts 4 --tokens 48 --json zipmoe.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moelab.compress.lossless import compress_model, open_store
from moelab.compress.lossless.bitfield import entropy_bits, split, tensor_bits
from moelab.compress.lossless.coders import decode_chunk, encode_chunk, symbol_table
from moelab.compress.lossless.model_store import expert_tensor_names, moe_layers
from moelab.compress.lossless.tensor_codec import chunk_bounds
from moelab.data import TokenStream, load_corpus, load_tokenizer
from moelab.models import load_model
from moelab.serve.engine import Engine, TokenEvent
from moelab.serve.offload import load_offloaded, offload_engine
from moelab.serve.offload.engine import MIB, free_cores
from moelab.serve.offload.policies import simulate
from moelab.serve.offload.trace import record_requests, record_trace
from moelab.serve.params import SamplingParams
from moelab.utils.atomic import atomic_write_json

SYSTEMS = (
    "no cache", "LRU", "frequency prefetch", "ZipMoE zstd", "ZipMoE LZ4HC", "ZipMoE argmin",
)  # fmt: skip
STORES = {"no cache": "raw", "LRU": "raw", "frequency prefetch": "raw", "ZipMoE zstd": "zstd",
          "ZipMoE LZ4HC": "lz4hc", "ZipMoE argmin": "zstd"}  # fmt: skip
CHUNKS = {"raw": 5, "zstd": 5, "lz4hc": 3}  # the authors evaluate LZ4HC with 3 chunks


def regime_kwargs(regime: str, latency_ms: float) -> dict:
    """``load_offloaded`` storage arguments of ``nvme`` or ``capN``."""
    if regime == "nvme":
        return dict(uncached=True)
    return dict(storage_mbps=float(regime.removeprefix("cap")), storage_latency_ms=latency_ms)


def system_kwargs(system: str, threads: int | None, k: int) -> dict:
    """``load_offloaded`` arguments of one system (the store is :data:`STORES`)."""
    if system == "no cache":
        return dict(policy="none", threads=0)
    if system == "LRU":
        return dict(policy="lru", threads=0)
    if system == "frequency prefetch":
        return dict(policy="lfu", threads=threads, prefetch=k, predictor="history")
    if system == "ZipMoE argmin":
        return dict(policy="zipmoe", threads=threads, planner="argmin", admission="hysteresis")
    return dict(policy="zipmoe", threads=threads)


def sizes(model) -> list[dict]:
    """Per tensor kind: elements, entropy bound, zstd / LZ4HC / ANS exponent bytes and the
    seconds one thread takes to decode them (``{codec}_s``)."""
    names = expert_tensor_names(model.cfg)
    codecs = {"zstd": 5, "lz4hc": 3, "ans": 5}
    rows = {n: dict(kind=n, elements=0, bound=0.0) for n in names}
    for r in rows.values():
        r.update({c: 0 for c in codecs} | {f"{c}_s": 0.0 for c in codecs})
    for _, layer in moe_layers(model):
        bank = layer.experts
        for n, w in ((names[0], bank.w_in), (names[1], bank.w_down)):
            for e in range(bank.num_experts):
                exp, _ = split(tensor_bits(w[e].detach()))
                table = symbol_table(exp)
                r = rows[n]
                r["elements"] += exp.size
                r["bound"] += exp.size * entropy_bits(exp) / 8
                for codec, chunks in codecs.items():
                    for a, b in chunk_bounds(exp.size, chunks):
                        blob = encode_chunk(codec, exp[a:b], table)
                        r[codec] += len(blob)
                        t0 = time.perf_counter()
                        decode_chunk(codec, blob, b - a, table)
                        r[f"{codec}_s"] += time.perf_counter() - t0
    return list(rows.values())


def parallel_decode(model, threads: int) -> dict[str, float]:
    """Per codec, the speed-up of decoding one expert tensor's 5 exponent chunks on
    ``threads`` threads against one (best of 5): whether the codec releases the GIL, which
    the scheduler's decode threads rely on."""
    from concurrent.futures import ThreadPoolExecutor

    exp, _ = split(tensor_bits(moe_layers(model)[0][1].experts.w_in[0].detach()))
    table = symbol_table(exp)
    out = {}
    for codec in ("zstd", "lz4hc", "ans"):
        jobs = [(encode_chunk(codec, exp[a:b], table), b - a) for a, b in chunk_bounds(exp.size, 5)]
        work = [jobs[i % len(jobs)] for i in range(4 * threads)]

        def one(job, codec=codec):
            return decode_chunk(codec, job[0], job[1], table)

        serial, par = [], []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(5):
                t0 = time.perf_counter()
                for j in work:
                    one(j)
                serial.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                list(pool.map(one, work))
                par.append(time.perf_counter() - t0)
        out[codec] = min(serial) / min(par)
    return out


def text_ids(tokenizer, corpus: str, n: int, skip: int = 0) -> torch.Tensor:
    docs = load_corpus(corpus, max_bytes_per_domain=max(200_000, 16 * (n + skip)))
    ids = TokenStream.from_documents(docs, tokenizer, name=corpus).ids
    return ids[skip : skip + n]


def timed_generation(model, prompt: list[int], tokens: int, snapshot=None):
    """(tokens, TTFT seconds (prompt to first token), TPOT seconds (per output token after the
    first), (statistics at the first token, at the end) from ``snapshot()``, or None): the
    differences are the decode steps' own reads and hits, the prefill's left out as in TPOT.

    Greedy, on a one-slot :class:`~moelab.serve.engine.Engine` driven here, its sequence's own
    ``ttft``/``tpot``, and the first snapshot taken in the token callback when the first token
    is sampled. (An engine step prefills and then decodes once, so a caller of
    :func:`generate_ids` sees the first token only after the second token's forward.)"""
    first = []

    def on_event(ev) -> None:
        if snapshot is not None and not first and isinstance(ev, TokenEvent):
            first.append(snapshot())

    engine = Engine(model.eval(), max_batch=1, max_queue=1, track_experts=False)
    seq = engine.submit(list(prompt), SamplingParams(max_tokens=tokens, temperature=0), on_event)
    while not seq.done.is_set():
        engine.step()
    if seq.finish_reason == "error":
        raise RuntimeError(f"generation failed: {seq.error}") from seq.exception
    stats = (first[0], snapshot()) if snapshot is not None else None
    return seq.output_ids, seq.ttft, seq.tpot or 0.0, stats


def build_store(model, folder: Path, codec: str, trace) -> None:
    if (folder / "store.json").is_file():
        try:
            open_store(folder)
            return
        except ValueError:
            pass
    compress_model(model, folder, codec=codec, chunks=CHUNKS[codec], trace=trace, overwrite=True)


def bench_run(run: Path, args) -> None:
    name = run.name
    model = load_model(run).to(torch.bfloat16).eval()
    tokenizer = load_tokenizer(run)
    L, E = model.cfg.num_moe_layers, model.cfg.moe.router.num_experts
    k = model.cfg.moe.router.top_k
    print(f"\n## {name}: {L} MoE layers × {E} experts, top-{k}, bf16", flush=True)

    # (1) sizes
    t0 = time.perf_counter()
    rows = [] if args.no_sizes else sizes(model)
    print(f"\n(1) lossless expert sizes ({time.perf_counter() - t0:.0f} s)")
    print(
        "| tensor | codec | elements | entropy H (bits/elt) | exp bits/elt (÷H) | total % of bf16 | decode ns/elt |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        n = r["elements"]
        h = 8 * r["bound"] / n
        for c in ("zstd", "lz4hc", "ans"):
            b = 8 * r[c] / n
            print(
                f"| {r['kind']} | {c} | {n:,} | {h:.3f} | {b:.3f} ({b / h:.3f}) | "
                f"{100 * (n + r[c]) / (2 * n):.1f} | {1e9 * r[f'{c}_s'] / n:.2f} |"
            )
    if rows:
        threads = args.threads or free_cores()
        sp = parallel_decode(model, max(2, threads))
        print(
            f"decoding one tensor's chunks on {max(2, threads)} threads vs 1: "
            + ", ".join(f"{c} ×{v:.2f}" for c, v in sp.items())
        )

    # stores and traces
    work = Path(args.work)
    profile = [
        text_ids(tokenizer, "shakespeare", 128, skip=4096 + 128 * i)
        for i in range(args.profile_seqs)
    ]
    trace = record_trace(model, profile)
    for store in sorted(set(STORES.values())):
        build_store(model, work / f"{name}-{store}", store, trace)
    prompts = [
        text_ids(tokenizer, "kjv", args.prompt_tokens, skip=4096 * i).tolist()
        for i in range(args.prompts)
    ]
    refs = [timed_generation(model, p, args.tokens)[0] for p in prompts]
    future = record_requests(model, lambda: timed_generation(model, prompts[0], args.tokens))
    print("\n(3) hit rate on the recorded decode requests of prompt 1 (simulation, one tier)")
    print("| budget | slots/layer | LRU | LFU | FIFO | Belady |")
    print("|---:|---:|---:|---:|---:|---:|")
    for pct in args.budgets:
        cap = int(pct / 100 * E)
        cells = []
        for p in ("lru", "lfu", "fifo", "belady"):
            hits = sum(sum(simulate(p, seq, cap)) for seq in future)
            cells.append(f"{100 * hits / sum(map(len, future)):.0f} %")
        print(f"| {pct} % | {cap} | " + " | ".join(cells) + " |")
    full_bytes = open_store(work / f"{name}-zstd").expert_bytes()[0]
    expert_total = L * E * full_bytes

    configs = [("in memory", None, None)]
    for regime in args.regimes:
        for pct in args.budgets:
            configs += [(s, pct, regime) for s in SYSTEMS]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    identical = True
    rng = random.Random(0)
    for rnd in range(args.repeats):
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            system, pct, regime = cfg
            if system == "in memory":
                outs = [timed_generation(model, p, args.tokens) for p in prompts]
                row = dict(
                    ttft=statistics.mean(o[1] for o in outs),
                    tpot=statistics.mean(o[2] for o in outs),
                )
            else:
                m = load_offloaded(
                    work / f"{name}-{STORES[system]}",
                    cache_mb=pct / 100 * expert_total / MIB, verify="off",
                    **regime_kwargs(regime, args.latency_ms),
                    **system_kwargs(system, args.threads, k),
                )  # fmt: skip
                eng = offload_engine(m)
                outs = [timed_generation(m, p, args.tokens, eng.snapshot) for p in prompts]
                row = decode_stats(outs, eng)
                eng.close()
                del m
            identical &= [o[0] for o in outs] == refs
            results[cfg].append(row)
            print(
                f"  {cfg}: TTFT {1e3 * row['ttft']:.0f} ms, TPOT {1e3 * row['tpot']:.0f} ms",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        print(f"round {rnd + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        table = print_speed(args, configs, results, prompts, expert_total, identical, rnd + 1)
        if args.json:
            atomic_write_json(args.json, dict(run=str(run), identical=identical, rows=table))


def decode_stats(outs: list, eng) -> dict:
    """TTFT and TPOT (mean over the prompts) and, over the decode steps of all prompts, MB
    read and experts loaded per output token, the share of requests each tier served, the
    tier plan."""
    n_dec = sum(max(len(o[0]) - 1, 0) for o in outs)
    d = dict(requests=0, hits_full=0, hits_sm=0, misses=0, prefetch_hits=0, bytes_read=0)
    for _, _, _, (a, b) in outs:
        for key in d:
            d[key] += getattr(b, key) - getattr(a, key)
    req = max(d["requests"], 1)
    return dict(
        ttft=statistics.mean(o[1] for o in outs),
        tpot=statistics.mean(o[2] for o in outs),
        full=d["hits_full"] / req,
        sm=d["hits_sm"] / req,
        miss=(d["misses"] - d["prefetch_hits"]) / req,
        prefetched=d["prefetch_hits"] / req,
        mb_per_token=d["bytes_read"] / 1e6 / max(n_dec, 1),
        loads_per_token=(d["hits_sm"] + d["misses"]) / max(n_dec, 1),
        plan=tiers_label(eng.plans or []),
    )


def tiers_label(plans: list) -> str:
    """``1F+2SM``, ``2F token-LFU`` (the planner's one-tier fallback), or the common label with
    the layers that differ."""

    def split(p) -> str:
        return f"{p.n_full}F+{p.n_sm}SM" if p.kind == "two_tier" else f"{p.n_full}F token-LFU"

    if not plans:
        return ""
    labels = [split(p) for p in plans]
    common = labels[-1]
    other = [x for x in labels if x != common]
    if not other:
        return common
    kinds = ", ".join(sorted(set(other)))
    return f"{common} ({len(other)} layer{'s' if len(other) > 1 else ''}: {kinds})"


def print_speed(args, configs, results, prompts, expert_total, identical, rounds) -> list[dict]:
    """The decoding table over the rounds measured so far; returns its rows."""
    print(
        f"\n(2) decoding, {len(prompts)} KJV prompts of {args.prompt_tokens} tokens × "
        f"{args.tokens} output tokens, {rounds} interleaved round(s), torch threads "
        f"{torch.get_num_threads()}, decode threads {args.threads or 'free cores'}; expert "
        f"bytes {expert_total / 1e6:.0f} MB; in-memory tokens reproduced by every offloaded "
        f"run: {'yes' if identical else 'NO'}. nvme = real reads, page cache dropped; capN = "
        f"emulated N MB/s + {args.latency_ms:g} ms/request (a CPU-to-I/O proxy)"
    )
    print(
        "| storage | budget | system | TPOT ms | TTFT ms | vs no cache | full / SM / prefetched / miss | MB read/token | loads/token | tiers/layer |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    table = []
    for cfg in configs:
        system, pct, regime = cfg
        rows = results[cfg]
        if not rows:
            continue
        tpot = [r["tpot"] for r in rows]
        ttft = statistics.mean(r["ttft"] for r in rows)
        last = rows[-1]
        out = dict(system=system, budget=pct, storage=regime, tpot_s=tpot, ttft_s=ttft)
        if system == "in memory":
            print(f"| - | 100 % | in memory | {_ms(tpot)} | {1e3 * ttft:.0f} | | | | | |")
            table.append(out)
            continue
        base = results.get(("no cache", pct, regime)) or []
        rel = ""
        if system != "no cache" and base:
            rel = f"{round(100 * (statistics.mean(tpot) / statistics.mean(r['tpot'] for r in base) - 1)):+d} %"
        print(
            f"| {regime} | {pct} % | {system} | {_ms(tpot)} | {1e3 * ttft:.0f} | {rel} | "
            f"{100 * last['full']:.0f} / {100 * last['sm']:.0f} / {100 * last['prefetched']:.0f} / "
            f"{100 * last['miss']:.0f} % | {last['mb_per_token']:.3g} | {last['loads_per_token']:.1f} | {last['plan']} |"
        )
        keys = ("full", "sm", "prefetched", "miss", "mb_per_token", "loads_per_token", "plan")
        table.append(out | {k: last[k] for k in keys})
    return table


def _ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.mean(xs):.1f} ± {1e3 * _sd(xs):.1f}"


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="run/model folder (repeatable)")
    ap.add_argument("--work", default="/tmp/zipmoe-bench", help="folder for the stores")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens per generation")
    ap.add_argument("--prompts", type=int, default=4, help="KJV prompts per configuration")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--profile-seqs", type=int, default=8, help="128-token sequences profiled")
    ap.add_argument(
        "--budgets", type=int, nargs="+", default=[10, 25, 50], help="%% of expert bytes"
    )
    ap.add_argument(
        "--regimes", nargs="+", default=["nvme", "cap150", "cap300", "cap600"],
        help="storage: nvme (real reads, page cache dropped) or capN (emulated N MB/s)",
    )  # fmt: skip
    ap.add_argument("--latency-ms", type=float, default=0.1, help="per request, capN regimes")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="decode threads (default: free)")
    ap.add_argument("--no-sizes", action="store_true", help="skip table (1)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed rounds (0: sizes and hit rates only)"
    )
    ap.add_argument("--json", default=None, help="write table (2) here as JSON")
    args = ap.parse_args()
    for r in args.regimes:
        if r != "nvme" and not (r.startswith("cap") and r[3:].replace(".", "", 1).isdigit()):
            ap.error(f"--regimes: nvme or capN (N in MB/s), got {r!r}")
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    np.random.seed(0)
    print(f"torch threads {torch.get_num_threads()}; decode threads {args.threads or free_cores()}")
    for run in args.run:
        bench_run(Path(run), args)


if __name__ == "__main__":
    main()
