"""Low-rank quantization of experts: RTN / GPTQ / GPTVQ × {none, per-expert, TileQ} at 2/3/4 bits.

For each trained run (default ``/work/runs/main``, 8 experts, and ``/work/runs/e16``, 16
experts) the expert banks are quantized with every combination of bits {2, 3, 4}, method
{RTN, GPTQ} (group size 64, asymmetric, GPTQ with act-order) — and with ``--methods gptvq``
GPTVQ (``--vq-dim`` dimensions, codebooks of 64 columns and the rows nearest the authors'
0.125-bit codebook overhead, ``moelab.compress.quant.codebook_rows``) — rank (``--ranks``,
default 8) and low-rank compensation:

- ``none`` (plain quantization);
- target ``W1`` — the authors' code pipeline (get_scale_quant.py in nicyyyy/GLoRCQ,
  grysgreat/Sketch_lopro): per-expert AWQ-style input scales, the low-rank term fitted to the
  fp weight once and kept, the residual quantized, ``Q(W − L) + L`` stored. Schemes:
  ``per-expert`` (LoPRo's per-matrix form) and ``tileq`` (one shared-Σ SVD of the block
  matrix on a k-means grid: 4×2 for 8 experts, 4×4 for 16); with ``--rotate-block B`` their
  GPTQ and GPTVQ rows (TileQ_s and TileQ_v) quantize the permuted, partially block-Hadamard-rotated residual (the authors'
  rotated GPTQ, act-order off; plain ``none`` GPTQ keeps act-order); with ``--w1-weightings
  awq diag`` the same pipeline also runs with one layer-pooled ``sqrt(diag H)`` scale shared
  by all experts instead of the per-expert AWQ scales (target ``W1d``, our variant [I]: the
  per-expert scales un-scale the shared factors' errors by up to ``1/min s_e``);
- with ``--old``, moelab's earlier reconstruction, target ``A`` (fit ``W − Q(W)``, layer-pooled
  ``(H + λI)^{1/2}`` weighting): ``per-expert``, ``shared-1d`` and ``tileq-core`` (r × r
  cores, HOOI, balanced most-square grid).

Each quantized model is scored on held-out text (the evaluation half of the run's validation
documents, per domain; the calibration half feeds the Hessians and the AWQ statistics).
Printed per row: validation bits per byte per domain and overall, total bits per expert
parameter (codes + scales + zeros + g_idx + low-rank factors + TileQ's input scales), the
extra low-rank bytes as stored, the low-rank entries as the authors' code counts them
(``lora_size``: ``r·(M·O + N·I)`` for TileQ, ``r·(I + O)`` per matrix; no Σ, no input
scales), and the low-rank overhead as a share of MoE-layer latency, TileQ's speed metric
(``quant_overhead.py``: layer 0's whole forward with and without its low-rank path, on a
prefill batch of 8 calibration sequences and on a decode step of 8 tokens; each scheme on its
own path).

The claim printout compares TileQ with per-expert **at the same rank and the same target**
(memory ratio as stored and as the code counts it; the fraction of per-expert's bits-per-byte
gain over plain quantization that TileQ keeps). The kept fraction is reported only where
plain quantization's loss increase over fp is at least 5× its noise estimate — the standard
error of the paired difference over evaluation windows, ``sqrt(n)·std_w(Δnats_w) / ln 2 /
bytes`` (windows of ``seq_len`` tokens, the same windows for every model, treated as
independent) — and as "not measurable" otherwise.

Sized for a contended 2-core box (one torch thread): Hessians come from one pass of the
full-precision model (``sequential=False``) shared by all settings of a run; 16 k calibration
tokens; 4 k evaluation tokens per domain (the same tokens for every setting).

Usage::

    python benchmarks/quantize.py --ranks 2 4 8                  # both runs
    python benchmarks/quantize.py --runs /work/runs/e16 --ranks 2 4 8 --old --rotate-block 64 \\
        --w1-weightings awq diag
    # the SmolLM2 testbed (benchmarks/smol_testbed.py; a folder without run.json reads --data)
    python benchmarks/quantize.py --runs runs/smol/g8 --bits 2 3 4 --ranks 4 --old \\
        --rotate-block 64 --only none/- per-expert/W1 shared-1d/A tileq/W1 \\
        --calib-tokens 32768 --eval-tokens 2048 --seeds 0 1 2 --json quantize-smol.json
    python benchmarks/quantize.py --runs /tmp/tiny --quick      # smoke (any small model folder)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compress_text import add_text_options, text_documents
from moelab.compress.calibration import calibration_set, domain_streams
from moelab.compress.quant import QuantizeConfig, codebook_rows, collect_hessians, quantize_layer
from moelab.compress.quant.lowrank import tileq_code_lora_params, tileq_grid
from moelab.core.experts.quantized import QuantSpec
from moelab.data import load_tokenizer
from moelab.models import ModelConfig, MoETransformer, load_model
from moelab.models.hooks import moe_layers
from moelab.train.evaluate import evaluate
from moelab.utils.results import BenchmarkResult, make_result, write_result
from quant_overhead import layer_inputs, lowrank_overhead

# target label -> (QuantizeConfig.target, QuantizeConfig.weighting)
TARGETS = {"W1": ("weight-once", "awq"), "W1d": ("weight-once", "diag"), "A": ("error", None)}
W1_LABELS = {"awq": "W1", "diag": "W1d"}


def default_grid(E: int) -> tuple[int, int]:
    """The most square M x N = E with M <= N."""
    m = int(E**0.5)
    while E % m:
        m -= 1
    return m, E // m


def split_experts(model: MoETransformer) -> MoETransformer:
    """A 2E-expert top-2k copy of ``model`` computing the same function (benchmark stand-in
    for a 16-expert run): every expert's hidden units are cut into two halves (fine-grained
    expert segmentation, DeepSeekMoE), each half a new expert with a copy of the router row,
    its down projection doubled (the softmax splits the expert's probability equally between
    the two equal logits, and top-2k picks both halves). Needs a softmax-before-top-k,
    normalised top-k token-choice router."""
    cfg = model.cfg
    r = cfg.moe.router
    if not (r.softmax_before_topk and r.norm_topk_prob and r.kind == "token_choice"):
        raise ValueError("split_experts: needs a normalised softmax-then-top-k router")
    d = cfg.to_dict()
    d["moe"]["router"]["num_experts"] = 2 * r.num_experts
    d["moe"]["router"]["top_k"] = 2 * r.top_k
    d["moe"]["experts"]["ffn_hidden_size"] = cfg.moe.experts.ffn_hidden_size // 2
    new = MoETransformer(ModelConfig.from_dict(d)).to(model.embed.weight.dtype).eval()
    state = model.state_dict()
    Fh = cfg.moe.experts.ffn_hidden_size
    h = Fh // 2
    for k, v in list(state.items()):
        if k.endswith("router.weight"):
            state[k] = v.repeat_interleave(2, dim=0)
        elif k.endswith("experts.w_gate_up"):
            gate, up = v[:, :, :Fh], v[:, :, Fh:]
            halves = [torch.cat([gate[:, :, i * h : (i + 1) * h], up[:, :, i * h : (i + 1) * h]], 2)
                      for i in range(2)]  # fmt: skip
            state[k] = torch.stack(halves, 1).flatten(0, 1)
        elif k.endswith("experts.w_down"):
            state[k] = 2 * torch.stack([v[:, :h], v[:, h:]], 1).flatten(0, 1)
    new.load_state_dict(state)
    return new


def settings(ranks: list[int], old: bool, w1: list[str]) -> list[tuple[str, str, int]]:
    """``(scheme, target label, rank)`` of every low-rank row (plus ``("none", "-", 0)``)."""
    out = [("none", "-", 0)]
    for r in ranks:
        for wt in w1:
            out += [("per-expert", W1_LABELS[wt], r), ("tileq", W1_LABELS[wt], r)]
        if old:
            out += [("per-expert", "A", r), ("shared-1d", "A", r), ("tileq-core", "A", r)]
    return out


def code_lora_params(model) -> int:
    """Low-rank entries as the authors' code counts them (``quant_infos["lora_size"]`` / bits,
    get_scale_quant.py): TileQ ``r·(M·O + N·I)`` per projection, ``r·(I + O)`` per matrix
    otherwise (shared-1d and tileq-core: what they store)."""
    total = 0
    for layer in moe_layers(model):
        spec = layer.experts.spec
        for p in layer.experts.projections.values():
            lr = p.lowrank
            if lr is None:
                continue
            K, O, I = p.shape  # noqa: E741
            if spec.lowrank == "tileq":
                total += tileq_code_lora_params(spec.grid, I, O, lr.rank)
            elif spec.lowrank == "per-expert":
                total += K * lr.rank * (I + O)
            else:
                total += lr.extra_params()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["/work/runs/main", "/work/runs/e16"],
        help="run folders; 'split:DIR' benchmarks DIR's experts split in two (2E experts, top-2k)",
    )
    ap.add_argument("--bits", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument(
        "--ranks", nargs="+", type=int, default=[8], help="low-rank ranks (the paper: r/d ~1%%)"
    )
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--vq-dim", type=int, default=2, help="GPTVQ's vector length d")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=4096, help="per domain")
    ap.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="calibration seeds (mean ± sd printed)"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these rows, as scheme/target (none/-, per-expert/W1, tileq/W1, "
        "shared-1d/A, ...); default: every row the other options make",
    )
    ap.add_argument(
        "--old",
        action="store_true",
        help="also run moelab's earlier reconstruction (target A: per-expert, shared-1d, "
        "tileq-core)",
    )
    ap.add_argument(
        "--weighting",
        default="full",
        choices=["full", "diag"],
        help="target A's activation weighting: full (H+λI)^1/2 or the notes' diag(sqrt(diag H))",
    )
    ap.add_argument(
        "--rotate-block",
        type=int,
        default=0,
        help="target W1's GPTQ rows: the authors' permuted partial block-Hadamard rotation of "
        "the residual with this Walsh block (e.g. 64; act-order off); 0: off",
    )
    ap.add_argument(
        "--w1-weightings",
        nargs="+",
        default=["awq"],
        choices=sorted(W1_LABELS),
        help="input scales of the code pipeline's rows: awq (the code's per-expert s_e; target "
        "W1) and/or diag (one layer-pooled sqrt(diag H) shared by the experts [I]; target W1d)",
    )
    ap.add_argument(
        "--methods", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq", "gptvq"]
    )
    add_text_options(ap)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 bits, RTN, rank 2, 1,024 calibration and 256 evaluation tokens",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument(
        "--result", type=Path, help="write the shared result JSON (moelab.result/1) here"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        help="print the table of saved --json files (e.g. one per calibration seed)",
    )
    args = ap.parse_args()
    if args.merge:
        merged = [r for f in args.merge for r in json.loads(f.read_text())]
        print_table(aggregate(merged))
        if args.result is not None:
            write_result(shared_result(merged, args), args.result)
        return
    if args.quick:
        args.bits, args.methods, args.ranks = [2], ["rtn"], [2]
        args.calib_tokens, args.eval_tokens = 1024, 256
    torch.manual_seed(args.seeds[0])
    torch.set_num_threads(args.threads)
    rows = []
    t_start = time.time()
    for i, run in enumerate(args.runs):
        if not run.startswith("split:") and not (Path(run) / "model.safetensors").exists():
            print(f"note: {run} has not finished training; using split:/work/runs/main instead")
            args.runs[i] = "split:/work/runs/main"
    for run in args.runs:
        split = run.startswith("split:")
        run = Path(run.removeprefix("split:"))
        fp = load_model(run).eval()
        tok = load_tokenizer(run)
        name = run.name
        if split:
            fp32 = fp
            fp = split_experts(fp32)
            name = f"{run.name}-split{fp.cfg.moe.router.num_experts}"
            probe = torch.randint(0, fp.cfg.vocab_size, (2, 64))
            with torch.no_grad():
                diff = (fp(probe).logits - fp32(probe).logits).abs().max().item()
            print(f"[{name}] split copy of {run}: max |logit diff| vs the original {diff:.2e}")
        calib_docs, eval_docs = text_documents(run, args)
        seq_len = min(256, fp.cfg.max_seq_len)
        streams = domain_streams(eval_docs, tok)
        E = fp.cfg.moe.router.num_experts
        widths = [fp.cfg.moe.experts.hidden_size, fp.cfg.moe.experts.ffn_hidden_size]
        grids = {"tileq": tileq_grid(E), "tileq-core": default_grid(E)}

        def score(model, streams=streams, seq_len=seq_len):
            """Per-domain and overall bpb, plus per-window nats [n] and the total bytes."""
            wins = []

            def nats_fn(model_, batch):
                logits = model_(batch.input_ids).logits.float()
                ce = F.cross_entropy(
                    logits.flatten(0, 1), batch.targets.flatten(), reduction="none"
                ).view(batch.targets.shape)
                wins.append(ce.double().sum(1).cpu())
                return float(ce.double().sum())

            r = evaluate(
                model, streams, seq_len=seq_len, batch_size=16, max_tokens=args.eval_tokens,
                nats_fn=nats_fn,
            )  # fmt: skip
            dom = {k: v.bits_per_byte for k, v in r.per_domain.items()}
            return dom, r.overall.bits_per_byte, torch.cat(wins), r.overall.bytes

        dom, overall, fp_wins, n_bytes = score(fp)
        n_exp = sum(b.experts.w_in.numel() + b.experts.w_down.numel() for b in moe_layers(fp))
        bits_fp = 8 * fp.blocks[0].ffn.experts.w_down.element_size()
        rows.append(dict(run=name, seed=None, bits="fp", method="-", lowrank="-", target="-", rank=0,
                         per_domain=dom, overall=overall, bits_per_param=bits_fp,
                         lowrank_bytes=0, code_lr_params=0, overhead=None, under=0, seconds=0.0,
                         noise=0.0))  # fmt: skip
        print(f"[{name}] fp32 overall {overall:.4f} bpb; {n_exp:,} expert weights; "
              f"tileq grid {grids['tileq']}, tileq-core grid {grids['tileq-core']}; "
              f"{fp_wins.numel()} eval windows", flush=True)  # fmt: skip
        for seed in args.seeds:
            calib = calibration_set(
                domain_streams(calib_docs, tok), tokens=args.calib_tokens, seq_len=seq_len,
                batch_size=8, seed=seed,
            )  # fmt: skip
            hess = collect_hessians(fp, calib)
            x_layer0 = layer_inputs(fp, calib.batches[:1])  # the quantized models' too
            for bits in args.bits:
                for method in args.methods:
                    for scheme, target, rank in settings(args.ranks, args.old, args.w1_weightings):
                        if args.only is not None and f"{scheme}/{target}" not in args.only:
                            continue
                        if method == "rtn" and scheme == "none" and seed != args.seeds[0]:
                            # calibration-free: the first seed's row stands for every seed
                            first = next(r for r in rows if (r["run"], r["bits"], r["method"],
                                         r["lowrank"]) == (name, bits, "rtn", "none"))  # fmt: skip
                            rows.append({**first, "seed": seed})
                            continue
                        t0 = time.time()
                        rot = (
                            args.rotate_block if method != "rtn" and target.startswith("W1") else 0
                        )
                        vq = method == "gptvq"
                        spec = QuantSpec(
                            method=method, bits=bits, group_size=args.group_size, symmetric=False,
                            act_order=method == "gptq" and not rot, lowrank=scheme, rank=rank,
                            grid=grids.get(scheme), rotate_block=rot,
                            vq_dim=args.vq_dim if vq else 0,
                            vq_rows=codebook_rows(bits, args.vq_dim, args.group_size, widths)
                            if vq else 0,
                        )  # fmt: skip
                        tgt, wt = TARGETS.get(target, (None, None))
                        cfg = QuantizeConfig(
                            spec=spec, sequential=False, seed=seed, target=tgt,
                            weighting=wt if target != "A" else args.weighting,
                        )  # fmt: skip
                        m = copy.deepcopy(fp)
                        reps = [
                            quantize_layer(layer, hess[i], cfg, i)
                            for i, layer in enumerate(moe_layers(m))
                        ]
                        dom, overall, wins, _ = score(m)
                        d = (wins - fp_wins) / math.log(2)  # paired per-window bits
                        noise = float(d.std() * math.sqrt(d.numel()) / n_bytes)
                        total = {}
                        for r in reps:
                            for k, v in r.bytes.items():
                                total[k] = total.get(k, 0) + v
                        weights = sum(r.weights for r in reps)
                        overhead = None
                        if scheme != "none":
                            overhead = lowrank_overhead(moe_layers(m)[0], x_layer0, budget_s=1.0)
                        rows.append(dict(
                            run=name, seed=seed, bits=bits, method=method, lowrank=scheme,
                            target=target, rank=rank, per_domain=dom, overall=overall,
                            bits_per_param=8 * sum(total.values()) / weights,
                            lowrank_bytes=total.get("lowrank", 0), code_lr_params=code_lora_params(m),
                            overhead=overhead, under=sum(len(r.under_calibrated) for r in reps),
                            seconds=time.time() - t0, noise=noise,
                        ))  # fmt: skip
                        print(
                            f"  {bits}b {method:4s} {scheme:10s} {target:2s} r{rank} {overall:.4f} bpb "
                            f"({time.time() - t0:.0f}s)",
                            flush=True,
                        )
    print_table(aggregate(rows))
    print(
        f"\ntotal wall time {time.time() - t_start:.0f}s (torch threads: {torch.get_num_threads()})"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.result is not None:
        write_result(shared_result(rows, args), args.result)


def shared_result(rows: list[dict], args) -> BenchmarkResult:
    """The rows as the shared result: one arm per (run, bits, method, low-rank, target, rank),
    calibration seeds as seeds (the calibration-free fp row stands for every seed); pairs:
    every low-rank row against plain quantization at its bits and method, the shared-factor
    rows also against per-expert at the same rank, plain quantization against fp, and every
    GPTVQ row against the GPTQ row of the same scheme (TileQ's "− vector quantization")."""
    seeds = sorted({r["seed"] for r in rows if r["seed"] is not None})
    metrics: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        arm = "/".join(str(r[k]) for k in ("run", "bits", "method", "lowrank", "target"))
        arm += f"/r{r['rank']}" if r["rank"] else ""
        m = {"bpb": r["overall"], **{f"bpb/{d}": v for d, v in r["per_domain"].items()},
             "bits_per_param": r["bits_per_param"], "lowrank_bytes": r["lowrank_bytes"]}  # fmt: skip
        if r["overhead"] is not None:
            m |= {f"lowrank_overhead/{p}": r["overhead"][f"{p}_overhead"]
                  for p in ("prefill", "decode")}  # fmt: skip
        for seed in seeds if r["seed"] is None else [r["seed"]]:
            metrics.setdefault(arm, {})[seed] = {k: float(v) for k, v in m.items()}
    pairs = []
    for arm in metrics:
        run, bits, method, lowrank, _, *rank = arm.split("/")
        scalar = arm.replace("/gptvq/", "/gptq/")
        if method == "gptvq" and scalar in metrics:  # the vector backend against the scalar one
            pairs.append((arm, scalar))
        if lowrank == "none":
            pairs.append((arm, f"{run}/fp/-/-/-"))
        elif bits != "fp":
            pairs.append((arm, f"{run}/{bits}/{method}/none/-"))
            if lowrank != "per-expert":  # the shared factors against per-expert's memory
                pairs += [(arm, other) for other in metrics
                          if other.startswith(f"{run}/{bits}/{method}/per-expert/")
                          and other.split("/")[5:] == rank]  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("merge", "json", "result")}
    return make_result("quantize", "tileq", json.loads(json.dumps(config, default=str)),
                       metrics, pairs=pairs)  # fmt: skip


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per setting over the calibration seeds: bits per byte (overall, per domain),
    noise and overheads averaged, ``overall_sd`` their standard deviation over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["run"], r["bits"], r["method"], r["lowrank"], r["target"], r["rank"])
        groups.setdefault(key, []).append(r)
    out = []
    for g in groups.values():
        a = dict(g[0])
        a["overall"] = statistics.fmean(r["overall"] for r in g)
        a["overall_sd"] = statistics.stdev(r["overall"] for r in g) if len(g) > 1 else 0.0
        a["per_domain"] = {d: statistics.fmean(r["per_domain"][d] for r in g)
                           for d in g[0]["per_domain"]}  # fmt: skip
        a["noise"] = statistics.fmean(r["noise"] for r in g)
        if a["overhead"] is not None:
            a["overhead"] = {k: statistics.fmean(r["overhead"][k] for r in g)
                             for k in a["overhead"]}  # fmt: skip
        out.append(a)
    return out


def print_table(rows: list[dict]) -> None:
    domains = sorted({d for r in rows for d in r["per_domain"]})
    head = ["run", "bits", "method", "low-rank", "target", "rank",
            *[f"bpb {d}" for d in domains], "bpb all", "bits/param", "extra LR KiB",
            "code-count LR", "LR overhead prefill", "LR overhead decode", "under-cal"]  # fmt: skip
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        cells = [r["run"], str(r["bits"]), r["method"], r["lowrank"], r["target"],
                 str(r["rank"] or "-"), *[f"{r['per_domain'][d]:.4f}" for d in domains],
                 f"{r['overall']:.4f}±{r['overall_sd']:.4f}", f"{r['bits_per_param']:.3f}",
                 f"{r['lowrank_bytes'] / 1024:.1f}", f"{r['code_lr_params']:,}",
                 *_overhead_cells(r["overhead"]), str(r["under"])]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print_claim(rows)


def _overhead_cells(o: dict | None) -> list[str]:
    if o is None:
        return ["-", "-"]
    return [f"{100 * o[f'{p}_overhead']:+.1f}% of {1e3 * o[f'{p}_without']:.2f} ms"
            for p in ("prefill", "decode")]  # fmt: skip


def _pct(row: dict) -> str:
    o = row["overhead"]
    return f"{100 * o['prefill_overhead']:+.0f}%/{100 * o['decode_overhead']:+.0f}%"


def print_claim(rows: list[dict]) -> None:
    """TileQ against per-expert at the same rank and target (see the module docstring)."""
    print("\nTileQ vs per-expert at the same rank and target (memory ratio stored / as the "
          "code counts it;")  # fmt: skip
    print("kept = (bpb none − bpb TileQ) / (bpb none − bpb per-expert), only where plain")
    print("quantization's increase over fp is >= 5x its paired per-window standard error):")
    pairs = {"W1": "tileq", "W1d": "tileq", "A": "tileq-core"}
    for run in dict.fromkeys(r["run"] for r in rows):
        fp = next(r for r in rows if r["run"] == run and r["bits"] == "fp")
        for bits in dict.fromkeys(r["bits"] for r in rows if r["run"] == run and r["bits"] != "fp"):
            for method in dict.fromkeys(r["method"] for r in rows if r["bits"] == bits):
                sel = [r for r in rows if (r["run"], r["bits"], r["method"]) == (run, bits, method)]
                none = next((r for r in sel if r["lowrank"] == "none"), None)
                if none is None:
                    continue
                inc = none["overall"] - fp["overall"]
                measurable = inc >= 5 * none["noise"]
                for target, tq_name in pairs.items():
                    for rank in sorted({r["rank"] for r in sel if r["target"] == target}):
                        get = {r["lowrank"]: r for r in sel
                               if r["target"] == target and r["rank"] == rank}  # fmt: skip
                        if not {"per-expert", tq_name} <= set(get):
                            continue
                        pe, tq = get["per-expert"], get[tq_name]
                        mem = pe["lowrank_bytes"] / tq["lowrank_bytes"]
                        mem_code = pe["code_lr_params"] / tq["code_lr_params"]
                        gain_pe = none["overall"] - pe["overall"]
                        gain_t = none["overall"] - tq["overall"]
                        if measurable and gain_pe > 0:
                            kept = f"keeps {100 * gain_t / gain_pe:.0f}% of per-expert's gain"
                        elif measurable:
                            kept = "per-expert gains nothing (kept fraction undefined)"
                        else:
                            kept = "kept fraction not measurable"
                        print(f"  {run} {bits}b {method} {tq_name} target {target} r{rank}: "
                              f"memory {mem:.2f}x / {mem_code:.2f}x less; quantization "
                              f"+{inc:.4f} bpb (noise {none['noise']:.4f}); gains "
                              f"{gain_pe:+.4f} (per-expert) vs {gain_t:+.4f} (TileQ) -> "
                              f"{kept}; LR overhead prefill/decode: per-expert "
                              f"{_pct(pe)} vs TileQ {_pct(tq)} (paper: ~5%)")  # fmt: skip


if __name__ == "__main__":
    main()
