"""`moelab serve` under load, and batched decoding against Hugging Face `generate`, in one run.

Part 1, load test (loopback only): starts ``moelab serve RUN`` as its own process, then for
each concurrency level C runs C clients that each send the same fixed number of streamed
completion requests one after another (asyncio + httpx). Per level it prints output
tokens/s (all completion tokens / wall time of the level), time to first token and time per
output token (p50/p99 over requests; TPOT = (last token − first token) / (tokens − 1)) and
the number of failed requests.

Part 2, decoding: the same weights in moelab (the serving engine, greedy, B sequences in one
batch) and in transformers (``moelab convert RUN DST --to hf``, ``AutoModelForCausalLM``,
``generate(do_sample=False, min_new_tokens=N)``), with the same B prompts of equal length
(no padding). Decode tokens/s = B·(N−1) / (T(N) − T(1)), where T(n) is the median wall time to
generate n tokens (prefill + first token cancels out). Calls are interleaved round-robin and
repeated (``benchmarks/_timing.py``); greedy tokens of both are compared.

Decoding a small batch is bound by reading the weights, and an MoE batch reads more of them
than one sequence does: every expert that any of the B tokens routes to. So the table also
gives the read bound on batch B's speed-up over batch 1: B · bytes(1) / bytes(B), with
bytes(B) the weights one decode step must read (everything but the expert banks and the
embedding table, plus each layer's experts that the step's tokens chose, counted on this very
greedy decode).

    python benchmarks/serve.py                                  # both models
    python benchmarks/serve.py --runs /work/runs/main --quick   # one model, smaller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _hf import decode_rate, ensure_hf, greedy_fns, load_hf
from _timing import interleaved_medians
from moelab.core.layer import MoELayer
from moelab.data import load_tokenizer
from moelab.models import MoETransformer, load_model

PROMPTS = [
    "ROMEO:",
    "def main(",
    "In the beginning God",
    "The capital of France is",
    "import os\nimport sys\n",
    "KING HENRY:",
    "And it came to pass",
    "class Node:",
]


@dataclass
class Setting:
    levels: tuple[int, ...]
    requests: int  # per client
    max_tokens: int
    max_batch: int
    decode_tokens: int  # N for part 2
    repeats: int


SETTINGS = {
    "small": Setting((1, 4, 16, 64), 4, 32, 64, 33, 5),
    "large": Setting((1, 4, 16, 64), 1, 8, 64, 17, 5),
}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    if c.get("text"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
    except httpx.HTTPError:
        return {"ok": False}
    if first is None:
        return {"ok": False}
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return {"ok": True, "ttft": first - start, "tpot": tpot, "tokens": tokens}


async def _level(base: str, model: str, clients: int, s: Setting) -> dict:
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(w: int) -> list[dict]:
            out = []
            for r in range(s.requests):
                body = {
                    "model": model,
                    "prompt": PROMPTS[(w + r) % len(PROMPTS)],
                    "max_tokens": s.max_tokens,
                    "temperature": 0.8,
                    "seed": 1000 * w + r,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                out.append(await _one(client, url, body))
            return out

        t = time.perf_counter()
        results = [
            x for xs in await asyncio.gather(*(worker(w) for w in range(clients))) for x in xs
        ]
        wall = time.perf_counter() - t
    ok = [x for x in results if x["ok"]]
    ttft = [x["ttft"] for x in ok]
    tpot = [x["tpot"] for x in ok if x["tpot"] is not None]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": sum(x["tokens"] for x in ok),
        "wall": wall,
        "tok_s": sum(x["tokens"] for x in ok) / wall,
        "ttft50": _pct(ttft, 50),
        "ttft99": _pct(ttft, 99),
        "tpot50": _pct(tpot, 50),
        "tpot99": _pct(tpot, 99),
        "errors": len(results) - len(ok),
    }


def load_test(run: Path, s: Setting, threads: int) -> list[dict]:
    port = _free_port()
    name = run.resolve().name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "moelab.cli", "serve", str(run), "--port", str(port),
           "--max-batch", str(s.max_batch), "--max-queue", "4096", "--timeout", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.5)
        warm = Setting((1,), 1, 4, s.max_batch, 0, 0)
        asyncio.run(_level(base, name, 1, warm))
        rows = []
        for c in s.levels:
            rows.append(asyncio.run(_level(base, name, c, s)))
            r = rows[-1]
            print(f"  {name} C={c}: {r['tok_s']:.1f} tok/s, errors {r['errors']}", flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def step_read_bytes(model: MoETransformer, decode: Callable[[], object], batch: int) -> float:
    """Mean bytes of weights that one batch-``batch`` decode step of ``decode()`` reads:
    the dense weights (all parameters outside the expert banks; the embedding table only when
    it is also the LM head, since a lookup reads B rows) plus, per MoE layer, the experts its
    tokens chose, averaged over the decode steps (the calls with ``batch`` tokens)."""

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    per_expert = {m: nbytes(m.experts.parameters()) / m.experts.num_experts for m in layers}
    skip = {id(p) for m in layers for p in m.experts.parameters()}
    if not model.cfg.tie_embeddings:
        skip.add(id(model.embed.weight))
    dense = nbytes(p for p in model.parameters() if id(p) not in skip)
    touched = []

    def hook(layer, args, out):
        if out.plan.logits.shape[0] == batch:
            touched.append(out.plan.expert_idx.unique().numel() * per_expert[layer])

    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        decode()
    finally:
        for h in handles:
            h.remove()
    return dense + sum(touched) / (len(touched) / len(layers))


def decode_compare(run: Path, hf_dir: Path, s: Setting) -> list[dict]:
    model = load_model(run).eval()
    tok = load_tokenizer(run)
    hf = load_hf(hf_dir, model.embed.weight.dtype)
    ids = tok.encode(" ".join(PROMPTS) * 4)
    prompts = [ids[3 * i : 3 * i + 16] for i in range(8)]
    ours, theirs = greedy_fns(model, hf, prompts)
    N = s.decode_tokens
    rows = []
    for B in (1, 8):
        same = ours(B, N) == theirs(B, N)
        fns = {
            "moelab N": lambda B=B: ours(B, N),
            "moelab 1": lambda B=B: ours(B, 1),
            "hf N": lambda B=B: theirs(B, N),
            "hf 1": lambda B=B: theirs(B, 1),
        }
        t = interleaved_medians(
            fns, repeats=s.repeats, warmup=1, budget_s=120, min_repeats=s.repeats
        )
        ours_tps = decode_rate(B, N, t["moelab N"], t["moelab 1"])
        hf_tps = decode_rate(B, N, t["hf N"], t["hf 1"])
        read = step_read_bytes(model, lambda B=B: ours(B, N), B)
        rows.append({"batch": B, "moelab": ours_tps, "hf": hf_tps, "same": same, "read": read})
        print(f"  decode B={B}: moelab {ours_tps:.1f} tok/s, HF {hf_tps:.1f} tok/s, "
              f"identical tokens: {same}, {read / 1e6:.0f} MB of weights read per step",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path,
                    default=[Path("/work/runs/main"), Path("/work/runs/smollm2-moe")])  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/moelab-serve-bench"),
                    help="where the HF exports are written (reused when present)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (server and decode)")
    ap.add_argument("--quick", action="store_true", help="levels 1 and 4, fewer repeats")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    load_rows, decode_rows = {}, {}
    t0 = time.perf_counter()
    for run in args.runs:
        params = sum(p.numel() for p in load_model(run).parameters())
        s = SETTINGS["small" if params < 50e6 else "large"]
        if args.quick:
            s = Setting((1, 4), s.requests, s.max_tokens, s.max_batch, s.decode_tokens, 3)
        name = run.resolve().name
        print(f"{name}: {params / 1e6:.1f}M params, {s}", flush=True)
        if not args.skip_load:
            load_rows[name] = (s, load_test(run, s, args.threads))
        if not args.skip_decode:
            decode_rows[name] = (s, decode_compare(run, ensure_hf(run, args.work), s))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, "
          f"{args.threads} threads\n")  # fmt: skip
    if load_rows:
        print("| model | clients | requests | max tokens | output tok/s | TTFT p50 / p99 (s) | "
              "TPOT p50 / p99 (ms) | errors |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for name, (s, rows) in load_rows.items():
            for r in rows:
                print(f"| {name} | {r['clients']} | {r['requests']} | {s.max_tokens} | "
                      f"{r['tok_s']:.1f} | {r['ttft50']:.3f} / {r['ttft99']:.3f} | "
                      f"{r['tpot50'] * 1e3:.1f} / {r['tpot99'] * 1e3:.1f} | {r['errors']} |")  # fmt: skip
        print()
    if decode_rows:
        print("| model | batch | new tokens | moelab decode tok/s | HF generate tok/s | "
              "moelab / HF | moelab vs its batch 1 | read bound on that | MB read per step | "
              "identical greedy tokens |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, (s, rows) in decode_rows.items():
            b1 = rows[0]
            for r in rows:
                bound = r["batch"] * b1["read"] / r["read"]
                print(f"| {name} | {r['batch']} | {s.decode_tokens} | {r['moelab']:.1f} | "
                      f"{r['hf']:.1f} | {r['moelab'] / r['hf']:.2f}x | "
                      f"{r['moelab'] / b1['moelab']:.2f}x | {bound:.2f}x | {r['read'] / 1e6:.0f} | "
                      f"{'yes' if r['same'] else 'no'} |")  # fmt: skip


if __name__ == "__main__":
    main()
