"""moelab against llama.cpp on the same weights: greedy tokens, prefill, decode at batch 1 and
aggregate decode at 4 and 8 parallel sequences, at F32 and at 8-bit.

For each run (default: the ``make run`` model and the upcycled SmolLM2-MoE) the model is
exported with ``moelab.interop.export_gguf`` (what ``moelab convert RUN OUT --to gguf`` does)
at F32 and at Q8_0, and llama.cpp runs the files through llama-cpp-python's low-level API
(``llama_decode`` on a context holding up to 8 sequences: the high-level ``Llama`` class
decodes one sequence at a time). moelab runs its serving engine (``moelab.serve.Engine``,
continuous batching over a slotted KV cache). Both get the same number of threads.

- **Greedy tokens at F32**: the same prompt, ``--tokens`` greedy tokens each; identical, or
  the first divergence with both libraries' logits of both candidate tokens.
- **Prefill**: a ``--prefill``-token prompt to its first sampled token; tokens/s.
- **Decode**: ``B`` prompts of 16 tokens generate ``N`` tokens each, greedy; aggregate decode
  tokens/s ``B·(N−1) / (T(N) − T(1))`` (prefill and first token cancel out), B = 1, 4, 8.
- **Compiled decode** (``--compile``): moelab's engine again with its decode steps through
  ``torch.compile`` (``Engine(compile=True)``, what ``moelab serve --compile`` runs), in the
  same interleaved runs; compiled once per model and batch before timing (after
  ``torch._dynamo.reset()``: past the recompile limit a forward silently runs eager), at F32
  and at 8-bit (the packed-code kernel is one operator in the graph,
  ``moelab::quant_rows_mm``).
- **Fused decode** (``--fused``): moelab's engine with each decode step as one C++ call over
  every block (``Engine(fused=True)``, what ``moelab serve --fused`` runs), in the same
  interleaved runs.
- **8-bit**: llama.cpp runs the Q8_0 file (every matrix but the routers 8-bit); moelab runs its
  own 8-bit model: experts (``quantize_model``, RTN, 8 bits, symmetric, groups of 64 columns)
  and every dense projection, attention and LM head (``quantize_dense``, the same grid): what
  ``moelab quantize --method rtn --bits 8 --symmetric --dense-bits 8`` writes; the embedding
  lookup stays float32. ``--experts-only`` keeps attention and head float32 (``--dense-bits
  0``). Not the same weights: only their speeds are compared.

The token check runs llama.cpp with a float32 K/V cache and without flash attention (the
F32 maths); the timings use llama.cpp's defaults (F16 K/V cache, flash attention where it
picks it), what its users get; moelab's cache is float32.

Timings: each measure's candidates interleaved round-robin, ``--repeats`` rounds
(``benchmarks/_timing.py``), the tables' rates medians over the rounds. The first table gives
moelab / llama.cpp ratios (> 1: moelab faster), the second each library's 8-bit speed over its
own F32 speed. ``--out`` gets the shared result JSON (arms ``moelab``, ``moelab compiled``,
``moelab fused``, ``llama.cpp``; a round is a seed, so each arm's difference from llama.cpp
pairs by round, with its confidence interval) and a markdown copy of the tables.

Usage::

    pip install 'moelab[llamacpp]'          # compiles llama.cpp (10-20 minutes on 2 cores)
    python benchmarks/llamacpp.py                                   # both models
    python benchmarks/llamacpp.py --runs runs/main --threads 2 --repeats 5
    python benchmarks/llamacpp.py --compile     # also moelab's decode through torch.compile
    python benchmarks/llamacpp.py --fused       # also moelab's fused C++ decode step
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _hf import decode_rate
from _timing import interleaved_samples
from moelab.data import load_tokenizer
from moelab.interop.gguf_export import export_gguf
from moelab.models import MoETransformer, load_model
from moelab.serve import Engine, SamplingParams
from moelab.utils.atomic import atomic_write_text
from moelab.utils.results import make_result, write_result

PROMPT_TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet "
    "is the sun. Arise, fair sun, and kill the envious moon, who is already sick and pale "
    "with grief that thou her maid art far more fair than she. def main(argv):\n    import "
    "sys\n    return 0\nAnd God said, Let there be light: and there was light. "
)


def ensure_gguf(run: Path, work: Path, outtype: str) -> Path:
    """``work/<run>-<digest>-<outtype>.gguf``: the run exported for llama.cpp, made once per
    run content (``digest``: of the run's ``manifest.json``, which holds its files' SHA-256,
    so a retrained run at the same path is exported again)."""
    digest = hashlib.sha256((run / "manifest.json").read_bytes()).hexdigest()[:12]
    path = work / f"{run.resolve().name}-{digest}-{outtype}.gguf"
    if not path.is_file():
        export_gguf(load_model(run), path, tokenizer=load_tokenizer(run), outtype=outtype)
    return path


def int8_model(model: MoETransformer, calib: torch.Tensor, dense: bool) -> MoETransformer:
    """``model`` quantized to 8 bits as ``moelab quantize --method rtn --bits 8 --symmetric
    --group-size 64 --dense-bits 8`` does (``dense``; else ``--dense-bits 0``: attention and
    head stay float32)."""
    from moelab.compress.quant.dense import quantize_dense
    from moelab.compress.quant.pipeline import QuantizeConfig, quantize_model
    from moelab.core.experts.quantized import QuantSpec

    spec = QuantSpec(method="rtn", bits=8, group_size=64, symmetric=True)
    quantize_model(model, [calib], QuantizeConfig(spec=spec, sequential=False))
    if dense:
        quantize_dense(model, 8, 64)
    return model.eval()


class LlamaCpp:
    """One GGUF file in llama.cpp, decoded through ``llama_decode`` with up to ``n_seq``
    sequences in one batch (each its own ``seq_id``), greedy argmax on the returned logits.
    ``exact``: float32 K/V cache and no flash attention (for the token check); otherwise
    llama.cpp's defaults (F16 K/V cache, flash attention where it chooses), what its users
    get."""

    def __init__(
        self, path: Path, threads: int, n_seq: int, n_ctx: int, exact: bool = False
    ) -> None:
        import llama_cpp as L

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.L = L
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(
            str(path).encode(), L.llama_model_default_params()
        )
        if not self.model:
            raise SystemExit(f"{path}: llama.cpp could not load it")
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_ctx, n_ctx, n_seq
        p.n_threads = p.n_threads_batch = threads
        if exact:
            p.type_k = p.type_v = L.GGML_TYPE_F32
            p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise SystemExit(f"{path}: llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_ctx, 0, n_seq)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Decode ``(token, position, seq_id, wants_logits)`` items in one batch; the logits of
        the items that want them, in order."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for i, (_, _, _, out) in enumerate(items):
            if out:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return rows

    def generate(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list]:
        """Greedy ``n`` tokens for each prompt, all in one batch; ``(tokens, logits of the
        first prompt at each step)``."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        items = [
            (t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)
        ]
        logits = self._decode(items)
        out = [[int(row.argmax())] for row in logits]
        trace = [logits[0]]
        for step in range(1, n):
            items = [(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, out, strict=True))]  # fmt: skip
            logits = self._decode(items)
            for o, row in zip(out, logits, strict=True):
                o.append(int(row.argmax()))
            trace.append(logits[0])
        return out, trace

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def moelab_generate(
    model: MoETransformer,
    prompts: list[list[int]],
    n: int,
    compile: bool = False,
    fused: bool = False,
) -> list[list[int]]:
    """Greedy ``n`` tokens for each prompt with moelab's serving engine, all in one batch
    (``compile``: its decode steps through ``torch.compile``; ``fused``: as one C++ call)."""
    engine = Engine(
        model, max_batch=len(prompts), track_experts=False, compile=compile, fused=fused
    )
    seqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


@torch.inference_mode()
def moelab_trace(model: MoETransformer, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """moelab's logits at each generated position of ``prompt + tokens``."""
    logits = model(torch.tensor([prompt + tokens])).logits[0]
    return [logits[len(prompt) - 1 + i].float().numpy() for i in range(len(tokens))]


def compare_greedy(model, cpp: LlamaCpp, prompt: list[int], n: int) -> str:
    """``"identical (n tokens)"`` or the first divergence with both libraries' logits."""
    ours = moelab_generate(model, [prompt], n)[0]
    theirs, their_logits = cpp.generate([prompt], n)
    theirs = theirs[0]
    if ours == theirs:
        mine = moelab_trace(model, prompt, ours)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(mine, their_logits, strict=True))
        return f"identical ({n} tokens, max |Δlogit| {worst:.1e})"
    i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    mine = moelab_trace(model, prompt, ours[: i + 1])[i]
    cpp_row = their_logits[i]
    a, b = ours[i], theirs[i]
    return (
        f"diverge at token {i}: moelab {a} ({mine[a]:.4f} vs {mine[b]:.4f}), "
        f"llama.cpp {b} ({cpp_row[a]:.4f} vs {cpp_row[b]:.4f})"
    )


ARMS = {"ours": "moelab", "compiled": "moelab compiled", "fused": "moelab fused"}
BASELINE = "llama.cpp"


def bench_type(label, model, cpp: LlamaCpp, prompts, long_prompt, args) -> dict:
    """Prefill and decode at B = 1, 4, 8: ``{measure: {arm: [tok/s per repeat]}}`` for the
    arms ``moelab`` and ``llama.cpp``, with ``--compile`` and ``--fused`` also ``moelab
    compiled`` / ``moelab fused`` (decode only), all from the same interleaved runs (repeat r
    of every arm in one round)."""
    N, S = args.tokens, len(long_prompt)
    t = interleaved_samples(
        {
            "ours": lambda: moelab_generate(model, [long_prompt], 1),
            "cpp": lambda: cpp.generate([long_prompt], 1),
        },
        repeats=args.repeats,
        budget_s=30,
        min_repeats=args.repeats,
    )
    row = {
        "prefill": {ARMS["ours"]: [S / x for x in t["ours"]], BASELINE: [S / x for x in t["cpp"]]}
    }
    for B in (1, 4, 8):
        ps = prompts[:B]
        fns = {
            "ours N": lambda ps=ps: moelab_generate(model, ps, N),
            "ours 1": lambda ps=ps: moelab_generate(model, ps, 1),
            "cpp N": lambda ps=ps: cpp.generate(ps, N),
            "cpp 1": lambda ps=ps: cpp.generate(ps, 1),
        }
        if args.compile:
            # each engine's batch size is a guard of the model's compiled forward, and past
            # torch.compile's recompile limit (8 graphs per function, all models together)
            # the forward falls back to eager: only this measure's graphs are kept
            torch._dynamo.reset()
            moelab_generate(model, ps, 3, compile=True)  # compiles (once per model and shape)
            fns["compiled N"] = lambda ps=ps: moelab_generate(model, ps, N, compile=True)
            fns["compiled 1"] = lambda ps=ps: moelab_generate(model, ps, 1, compile=True)
        if args.fused:
            fns["fused N"] = lambda ps=ps: moelab_generate(model, ps, N, fused=True)
            fns["fused 1"] = lambda ps=ps: moelab_generate(model, ps, 1, fused=True)
        t = interleaved_samples(fns, repeats=args.repeats, budget_s=60, min_repeats=args.repeats)
        rates = {
            BASELINE if who == "cpp" else ARMS[who]: [
                decode_rate(B, N, tn, t1)
                # a call longer than the budget gets one sample: pair the rounds both have
                for tn, t1 in zip(t[f"{who} N"], t[f"{who} 1"], strict=False)
            ]
            for who in ("ours", "cpp", "compiled", "fused")
            if f"{who} N" in t
        }
        row[f"decode B={B}"] = rates
    for _, _, key, rates, cpp_rates in against_llamacpp(row):
        ours, theirs = statistics.median(rates), statistics.median(cpp_rates)
        print(f"  {label:5s} {key:20s} {ours:9.1f} tok/s  llama.cpp {theirs:9.1f} tok/s  {ours / theirs:.2f}x", flush=True)  # fmt: skip
    return row


def against_llamacpp(row: dict):
    """``(measure, arm, row label, the arm's rates, llama.cpp's rates)`` for every moelab arm
    of every measure of ``row`` (``{measure: {arm: [tok/s per repeat]}}``)."""
    for measure, arms in row.items():
        for arm, rates in arms.items():
            if arm != BASELINE:
                label = measure if arm == ARMS["ours"] else f"{arm.split()[1]} {measure}"
                yield measure, arm, label, rates, arms[BASELINE]


def bench_run(run: Path, args) -> dict:
    model = load_model(run).eval()
    tok = load_tokenizer(run)
    ids = tok.encode(PROMPT_TEXT * 8)
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    prompts = [torch.randint(0, V, (16,), generator=g).tolist() for _ in range(8)]
    long_prompt = ids[: args.prefill]
    n_ctx = 8 * (16 + args.tokens) + args.prefill
    params = sum(p.numel() for p in model.parameters())
    print(f"{run.name}: {params / 1e6:.1f}M params, vocab {V}", flush=True)
    out = {"run": run.name, "params_M": params / 1e6}
    exact = LlamaCpp(ensure_gguf(run, args.work, "f32"), args.threads, 1, n_ctx, exact=True)
    out["greedy"] = compare_greedy(model, exact, ids[:32], args.tokens)
    exact.close()
    print(f"  greedy at F32: {out['greedy']}", flush=True)
    f32 = LlamaCpp(ensure_gguf(run, args.work, "f32"), args.threads, 8, n_ctx)
    out["f32"] = bench_type("f32", model, f32, prompts, long_prompt, args)
    f32.close()
    q8 = LlamaCpp(ensure_gguf(run, args.work, "q8_0"), args.threads, 8, n_ctx)
    calib = torch.tensor([ids[i : i + 64] for i in range(0, 8 * 64, 64)])
    start = time.perf_counter()
    int8 = int8_model(load_model(run), calib, dense=not args.experts_only)
    print(f"  moelab 8-bit model in {time.perf_counter() - start:.0f} s", flush=True)
    out["8-bit"] = bench_type("8-bit", int8, q8, prompts, long_prompt, args)
    q8.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path,
                    default=[Path("runs/main"), Path("runs/smollm2-moe")])  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/moelab-llamacpp"),
                    help="where the GGUF exports are written (reused when present)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="threads for each library")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=33, help="greedy tokens per sequence")
    ap.add_argument("--prefill", type=int, default=128, help="prefill prompt tokens")
    ap.add_argument("--compile", action="store_true",
                    help="also time moelab's decode through torch.compile (Engine(compile=True))")  # fmt: skip
    ap.add_argument("--fused", action="store_true",
                    help="also time moelab's fused C++ decode step (Engine(fused=True))")  # fmt: skip
    ap.add_argument("--experts-only", action="store_true",
                    help="moelab's 8-bit model: experts only, attention and head float32")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/bench/llamacpp.json"),
                    help="the shared result JSON (and a markdown copy of the tables beside it)")  # fmt: skip
    args = ap.parse_args()
    if len({run.name for run in args.runs}) < len(args.runs):
        ap.error("--runs: the runs' directory names name their rows, and two are the same")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [bench_run(run, args) for run in args.runs]
    import llama_cpp

    elapsed = time.perf_counter() - t0
    head = (
        f"torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, "
        f"{args.threads} threads each, {args.repeats} interleaved repeats, total {elapsed:.0f} s"
    )
    tables = render(rows, args.experts_only)
    per_arm = metrics(rows)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["runs"] = [str(r) for r in args.runs]
    result = make_result(
        "llamacpp",
        "moelab decode (serving engine)",
        settings,
        per_arm,
        pairs=[(arm, BASELINE) for arm in per_arm if arm != BASELINE],
        extra={"greedy": {r["run"]: r["greedy"] for r in rows}, "wall_seconds": elapsed},
    )
    write_result(result, args.out)
    atomic_write_text(args.out.with_suffix(".md"), f"{head}\n\n{tables}")
    print(f"\n{head}\n\n{tables}\nresult: {args.out}")


def metrics(rows: list[dict]) -> dict[str, dict[int, dict[str, float]]]:
    """The shared result's ``{arm: {repeat: {"<run> <weights> <measure>": tok/s}}}``: repeat r
    of every arm comes from one interleaved round, so differences pair by repeat."""
    series = [
        (arm, f"{r['run']} {kind} {measure}", rates)
        for r in rows
        for kind in ("f32", "8-bit")
        for measure, arms in r[kind].items()
        for arm, rates in arms.items()
    ]
    # a call longer than its budget gets fewer samples, and the result's arms share one set of
    # seeds: the rounds every series has
    repeats = min(len(rates) for _, _, rates in series)
    short = sorted({f"{arm}: {name}" for arm, name, rates in series if len(rates) == repeats})
    if any(len(rates) > repeats for _, _, rates in series):
        print(f"result JSON: {repeats} round(s), the most that {', '.join(short)} took")
    out: dict[str, dict[int, dict[str, float]]] = {}
    for arm, name, rates in series:
        for i in range(repeats):
            out.setdefault(arm, {}).setdefault(i, {})[name] = rates[i]
    return out


def render(rows: list[dict], experts_only: bool) -> str:
    """The markdown tables: moelab / llama.cpp per measure (medians over the repeats), each
    library's 8-bit over its own F32 speed, and the greedy token checks."""
    med = statistics.median
    lines = [
        "| model | weights | measure | moelab tok/s | llama.cpp tok/s | moelab / llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for kind in ("f32", "8-bit"):
            eight = "int8 experts" if experts_only else "int8 experts + dense"
            weights = "F32 both" if kind == "f32" else f"moelab {eight} / llama.cpp Q8_0"
            for _, _, key, rates, cpp_rates in against_llamacpp(r[kind]):
                a, b = med(rates), med(cpp_rates)
                lines.append(f"| {r['run']} | {weights} | {key} | {a:.1f} | {b:.1f} | {a / b:.2f}× |")  # fmt: skip
    lines += [
        "",
        "| model | measure | moelab 8-bit / moelab F32 | llama.cpp Q8_0 / llama.cpp F32 |",
        "|---|---|---|---|",
    ]
    for r in rows:
        f32 = r["f32"]
        for measure, arm, key, rates, cpp_rates in against_llamacpp(r["8-bit"]):
            ours = med(rates) / med(f32[measure][arm])
            theirs = med(cpp_rates) / med(f32[measure][BASELINE])
            lines.append(f"| {r['run']} | {key} | {ours:.2f}× | {theirs:.2f}× |")
    lines.append("")
    lines += [f"{r['run']}: greedy tokens at F32: {r['greedy']}" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
