"""ZipMoE (ICML 2026, arXiv 2601.21198) on moelab models: lossless expert sizes and offloaded
decoding speed.

For every ``--run`` (cast to bf16):

1. **Sizes**: every expert tensor split into exponent and sign-mantissa bytes; the exponent
   stream coded in 5 independent chunks with zstd (level 1, the authors' default) and with
   ANS (``constriction``), against the order-0 entropy bound ``N·H/8``; totals as % of bf16.
2. **Decoding speed** (greedy, batch 1, time per output token after the first, prefill
   excluded; the hit rates and bytes read per token count the same decode steps) at
   expert-cache budgets of 25/50/75 % of the expert bytes, real file reads (page
   cache warm) and with the storage bandwidth cap emulated (``--storage-mbps``):
   - *in memory*: all experts resident (upper bound);
   - *naive offload*: uncompressed store, LRU, every miss read and converted on the forward
     thread;
   - *LFU + prefetch* (MoE-Infinity-like): uncompressed store, LFU, the next layer's top-k
     predicted experts prefetched on a background thread;
   - *ZipMoE*: zstd store, planned full/sign-mantissa tiers, token-weighted LFU with
     admission, the Type-I/II scheduler on ``--threads`` decode threads;
   - *ZipMoE + gate prefetch*: the same, plus ``--gate-prefetch`` experts of the next layer
     guessed by its router on the current hidden state and loaded at prefetch priority
     (:mod:`moelab.serve.offload.lookahead`; not part of ZipMoE).
   Every configuration is run ``--repeats`` times, the configurations shuffled per round
   (interleaved, so background load hits all alike); mean ± sd over the rounds. Every
   offloaded generation is checked token for token against the in-memory one.
3. **Hit rates on the recorded decode trace** (simulation): LRU, LFU, FIFO, token-LFU and
   Belady's bound at the single-tier slot count of each budget.

Stores are written under ``--work`` (reused when present). Decoded tensors are not
sha256-checked in the timed runs (``verify="off"``: the round trip was verified when the
store was written, and every segment's CRC-32 is still checked on every read).

Example (table (2) of docs/methods/zipmoe.md):
  python benchmarks/zipmoe.py --run runs/smollm2-moe --run runs/main \\
      --tokens 16 --repeats 2 --no-sizes --storage-mbps 300
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
from moelab.serve.generate import generate_ids
from moelab.serve.offload import load_offloaded, offload_engine
from moelab.serve.offload.engine import MIB
from moelab.serve.offload.policies import simulate
from moelab.serve.offload.trace import record_requests, record_trace

SYSTEMS = ("naive offload", "LFU + prefetch", "ZipMoE", "ZipMoE + gate prefetch")


def sizes(model) -> list[dict]:
    """Per tensor kind: elements, entropy bound, zstd / ANS exponent bytes and the seconds
    one thread takes to decode them (``{codec}_s``)."""
    names = expert_tensor_names(model.cfg)
    rows = {
        n: dict(kind=n, elements=0, bound=0.0, zstd=0, ans=0, zstd_s=0.0, ans_s=0.0) for n in names
    }
    for _, layer in moe_layers(model):
        bank = layer.experts
        for n, w in ((names[0], bank.w_in), (names[1], bank.w_down)):
            for e in range(bank.num_experts):
                exp, _ = split(tensor_bits(w[e].detach()))
                table = symbol_table(exp)
                r = rows[n]
                r["elements"] += exp.size
                r["bound"] += exp.size * entropy_bits(exp) / 8
                for codec in ("zstd", "ans"):
                    for a, b in chunk_bounds(exp.size, 5):
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
    for codec in ("zstd", "ans"):
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
    """(tokens, seconds per output token after the first, (statistics at the first token, at
    the end) from ``snapshot()``, or None): the differences are the decode steps' own reads
    and hits, the prefill's left out as in the timing."""
    stamps, out, first = [], [], None
    for t in generate_ids(model, list(prompt), max_new_tokens=tokens, temperature=0):
        stamps.append(time.perf_counter())
        out.append(t)
        if snapshot is not None and first is None:
            first = snapshot()
    per_token = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return out, per_token, (first, snapshot()) if snapshot is not None else None


def build_store(model, folder: Path, codec: str, trace) -> None:
    if (folder / "store.json").is_file():
        try:
            open_store(folder)
            return
        except ValueError:
            pass
    compress_model(model, folder, codec=codec, trace=trace, overwrite=True)


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
        "| tensor | elements | entropy H (bits/elt) | zstd exp bits/elt (÷H) | ANS exp bits/elt (÷H) | total zstd % of bf16 | total ANS % of bf16 | zstd decode ns/elt | ANS decode ns/elt |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        n = r["elements"]
        h = 8 * r["bound"] / n
        z, a = 8 * r["zstd"] / n, 8 * r["ans"] / n
        print(
            f"| {r['kind']} | {n:,} | {h:.3f} | {z:.3f} ({z / h:.3f}) | {a:.3f} ({a / h:.3f}) | "
            f"{100 * (n + r['zstd']) / (2 * n):.1f} | {100 * (n + r['ans']) / (2 * n):.1f} | "
            f"{1e9 * r['zstd_s'] / n:.2f} | {1e9 * r['ans_s'] / n:.2f} |"
        )
    if rows:
        sp = parallel_decode(model, args.threads)
        print(
            f"decoding one tensor's chunks on {args.threads} threads vs 1: "
            + ", ".join(f"{c} ×{v:.2f}" for c, v in sp.items())
        )

    # stores and traces
    work = Path(args.work)
    profile = [
        text_ids(tokenizer, "shakespeare", 128, skip=4096 + 128 * i)
        for i in range(args.profile_seqs)
    ]
    trace = record_trace(model, profile)
    build_store(model, work / f"{name}-raw", "raw", trace)
    build_store(model, work / f"{name}-zstd", "zstd", trace)
    prompt = text_ids(tokenizer, "kjv", args.prompt_tokens).tolist()
    ref, _, _ = timed_generation(model, prompt, args.tokens)
    future = record_requests(model, lambda: timed_generation(model, prompt, args.tokens))
    print("\n(3) hit rate on the recorded decode requests (simulation, single tier)")
    print("| budget | slots/layer | LRU | LFU | FIFO | token-LFU | Belady |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for pct in args.budgets:
        cap = int(pct / 100 * E)
        cells = []
        for p in ("lru", "lfu", "fifo", "zipmoe", "belady"):
            hits = sum(sum(simulate(p, seq, cap)) for seq in future)
            cells.append(f"{100 * hits / sum(map(len, future)):.0f} %")
        print(f"| {pct} % | {cap} | " + " | ".join(cells) + " |")
    full_bytes = open_store(work / f"{name}-zstd").expert_bytes()[0]
    expert_total = L * E * full_bytes

    configs = [("in memory", None, None)]
    for pct in args.budgets:
        for cap in (None, args.storage_mbps):
            configs += [(s, pct, cap) for s in SYSTEMS]
    results: dict[tuple, list[float]] = {c: [] for c in configs}
    stats: dict[tuple, dict] = {}
    identical = True
    rng = random.Random(0)
    for rnd in range(args.repeats):
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            system, pct, cap = cfg
            if system == "in memory":
                out, s, _ = timed_generation(model, prompt, args.tokens)
            else:
                cache_mb = pct / 100 * expert_total / MIB
                kw = dict(cache_mb=cache_mb, storage_mbps=cap, verify="off", check_pack=False)
                if system == "naive offload":
                    m = load_offloaded(work / f"{name}-raw", policy="lru", threads=0, **kw)
                elif system == "LFU + prefetch":
                    m = load_offloaded(
                        work / f"{name}-raw", policy="lfu", threads=args.threads, prefetch=k,
                        predictor="history", **kw,
                    )  # fmt: skip
                else:
                    m = load_offloaded(
                        work / f"{name}-zstd", policy="zipmoe", threads=args.threads,
                        prefetch=args.gate_prefetch if system.endswith("gate prefetch") else 0,
                        **kw,
                    )  # fmt: skip
                eng = offload_engine(m)
                out, s, (a, b) = timed_generation(m, prompt, args.tokens, eng.snapshot)
                requests = max(b.requests - a.requests, 1)
                plans = eng.plans or []
                stats[cfg] = dict(
                    hit_full=(b.hits_full - a.hits_full) / requests,
                    hit_sm=(b.hits_sm - a.hits_sm) / requests,
                    mb_per_token=(b.bytes_read - a.bytes_read) / 1e6 / max(len(out) - 1, 1),
                    prefetch_used=(b.prefetch_hits - a.prefetch_hits)
                    / max(b.prefetch_issued - a.prefetch_issued, 1)
                    if b.prefetch_issued > a.prefetch_issued
                    else None,
                    plan=tiers_label(plans),
                )
                eng.close()
                del m
            identical &= out == ref
            results[cfg].append(s)
            print(f"  {cfg}: {1e3 * s:.0f} ms/token", file=sys.stderr, flush=True)
        print(f"round {rnd + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        print_speed(args, configs, results, stats, prompt, expert_total, identical, rnd + 1)


def tiers_label(plans: list) -> str:
    """``2F+0SM``, or ``2F+0SM (1 layer: 1F+1SM)`` when the staging buffer re-planned some."""

    def split(p) -> str:
        return f"{p.n_full}F+{p.n_sm}SM" if p.kind == "two_tier" else f"{p.n_full}F LFU"

    if not plans:
        return ""
    labels = [split(p) for p in plans]
    common = labels[-1]
    other = [x for x in labels if x != common]
    if not other:
        return common
    kinds = ", ".join(sorted(set(other)))
    return f"{common} ({len(other)} layer{'s' if len(other) > 1 else ''}: {kinds})"


def print_speed(args, configs, results, stats, prompt, expert_total, identical, rounds) -> None:
    """The decoding table over the rounds measured so far."""
    print(
        f"\n(2) decoding, {args.tokens} output tokens after a {len(prompt)}-token KJV prompt, "
        f"{rounds} interleaved round(s), {args.threads} decode threads; expert bytes "
        f"{expert_total / 1e6:.0f} MB; in-memory tokens reproduced by every offloaded run: "
        f"{'yes' if identical else 'NO'}"
    )
    print(
        "| storage | budget | system | ms/token | tok/s | vs naive | hit full / SM | MB read/token | prefetches used | tiers/layer |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    mem = results[configs[0]]
    print(
        f"| - | 100 % | in memory | {1e3 * statistics.mean(mem):.1f} ± {1e3 * _sd(mem):.1f} | {1 / statistics.mean(mem):.2f} | | | | | |"
    )
    for cap in (None, args.storage_mbps):
        for pct in args.budgets:
            naive = statistics.mean(results[("naive offload", pct, cap)])
            for system in SYSTEMS:
                ts = results[(system, pct, cap)]
                st = stats[(system, pct, cap)]
                mean = statistics.mean(ts)
                rel = "" if system == "naive offload" else f"{round(100 * (mean / naive - 1)):+d} %"
                used = "" if st["prefetch_used"] is None else f"{100 * st['prefetch_used']:.0f} %"
                print(
                    f"| {'page cache' if cap is None else f'{cap:g} MB/s cap'} | {pct} % | {system} | "
                    f"{1e3 * mean:.1f} ± {1e3 * _sd(ts):.1f} | {1 / mean:.2f} | {rel} | "
                    f"{100 * st['hit_full']:.0f} % / {100 * st['hit_sm']:.0f} % | "
                    f"{st['mb_per_token']:.1f} | {used} | {st['plan']} |"
                )


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="run/model folder (repeatable)")
    ap.add_argument("--work", default="/tmp/zipmoe-bench", help="folder for the stores")
    ap.add_argument("--tokens", type=int, default=8, help="output tokens per generation")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--profile-seqs", type=int, default=8, help="128-token sequences profiled")
    ap.add_argument(
        "--budgets", type=int, nargs="+", default=[25, 50, 75], help="% of expert bytes"
    )
    ap.add_argument("--storage-mbps", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--gate-prefetch", type=int, default=1, help="experts prefetched per layer (gate row)"
    )
    ap.add_argument("--no-sizes", action="store_true", help="skip table (1)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed rounds (0: sizes and hit rates only)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    print(f"torch threads {torch.get_num_threads()}; storage cap {args.storage_mbps:g} MB/s")
    for run in args.run:
        bench_run(Path(run), args)


if __name__ == "__main__":
    main()
