"""Low-rank quantization of experts: RTN / GPTQ × {none, per-expert, 1-D, TileQ} at 2/3/4 bits.

For each trained run (default ``/work/runs/main``, 8 experts, grid 2x4, and ``/work/runs/e16``,
16 experts, grid 4x4) the expert banks are quantized with every combination of bits
{2, 3, 4}, method {RTN, GPTQ} and low-rank compensation {none, per-expert, shared-1d, TileQ}
(rank 8, group size 64, asymmetric, GPTQ with act-order) — the low-rank factors fitted
either to the quantization error ``W − Q(W)`` (target A, the research notes' reconstruction)
or to the weights first with the residual quantized (target B), weighted by the layer-pooled
``(H + λI)^{1/2}`` (``--weighting diag`` for the notes' ``diag(sqrt(diag H))``) — and each quantized model is scored
on held-out text (the evaluation half of the run's validation documents, per domain; the
calibration half feeds the Hessians). Printed per row: validation bits per byte per domain
and overall, total bits per expert parameter (codes + scales + zeros + g_idx + low-rank
factors), the extra low-rank bytes, and — per low-rank scheme — the speed of the fused
low-rank path against a per-expert loop on one layer's routed rows (down projection,
medians of interleaved repeats). A summary line per (run, bits, method) checks TileQ's claim:
≥ 3x less extra memory than per-expert at the same rank and ≥ 70 % of its bits-per-byte
improvement over plain quantization.

Sized for a contended 2-core box (one torch thread): Hessians come from one pass of the
full-precision model (``sequential=False``) shared by all settings of a run; 16 k calibration
tokens; 4 k evaluation tokens per domain (the same tokens for every setting, so differences
between rows are paired); target B only for per-expert and TileQ by default.

Usage::

    python benchmarks/quantize.py                              # both runs (~30 min here)
    python benchmarks/quantize.py --runs /work/runs/main --eval-tokens 8192
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_medians
from moelab.compress.calibration import (
    calibration_set,
    domain_streams,
    held_out_documents,
    route,
    routed_pairs,
)
from moelab.compress.quant import QuantizeConfig, collect_hessians, quantize_layer
from moelab.compress.quant.pipeline import run_data
from moelab.core.experts.lowrank import expert_of_rows
from moelab.core.experts.quantized import QuantSpec
from moelab.data import load_tokenizer
from moelab.models import ModelConfig, MoETransformer, load_model
from moelab.models.hooks import moe_layers
from moelab.train.evaluate import evaluate

SCHEMES = ("none", "per-expert", "shared-1d", "tileq")
TARGETS = {"A": "error", "B": "weight"}


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


def fused_speed(model, calib, specs_models: dict[str, object]) -> dict[str, float]:
    """Loop time / fused time of the down projection's correction on layer 0's routed rows."""
    layer0 = moe_layers(model)[0]
    got = {}

    def grab(i, layer, x, out):
        if i == 0 and not got:
            pairs = routed_pairs(layer, x, out.plan)
            _, a = layer.experts(pairs.x, pairs.counts, return_activations=True)
            got["a"], got["counts"] = a, pairs.counts

    route(model, calib.batches[:2], grab, upto_layer=0)
    del layer0
    a, counts = got["a"], got["counts"]
    experts = expert_of_rows(counts)
    out = {}
    for scheme, qmodel in specs_models.items():
        lr = moe_layers(qmodel)[0].experts.projections["down"].lowrank
        t = interleaved_medians(
            {
                "fused": lambda lr=lr: lr.apply_rows(a, experts),
                "loop": lambda lr=lr: lr.apply_loop(a, counts),
            },
            repeats=7,
            budget_s=2.0,
        )
        out[scheme] = t["loop"] / t["fused"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["/work/runs/main", "/work/runs/e16"],
        help="run folders; 'split:DIR' benchmarks DIR's experts split in two (2E experts, top-2k)",
    )
    ap.add_argument("--bits", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=4096, help="per domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--targets",
        nargs="+",
        default=["A", "B"],
        choices=sorted(TARGETS),
        help="low-rank target: A = fit W − Q(W) (notes' reconstruction), B = fit W, quantize the rest",
    )
    ap.add_argument(
        "--b-schemes",
        nargs="+",
        default=["per-expert", "tileq"],
        choices=SCHEMES[1:],
        help="low-rank schemes also run with target B",
    )
    ap.add_argument(
        "--weighting",
        default="full",
        choices=["full", "diag"],
        help="low-rank activation weighting: full (H+λI)^1/2 or the notes' diag(sqrt(diag H))",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
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
        rd = run_data(run)
        calib_docs, eval_docs = held_out_documents(rd)
        seq_len = min(256, fp.cfg.max_seq_len)
        calib = calibration_set(
            domain_streams(calib_docs, tok), tokens=args.calib_tokens, seq_len=seq_len,
            batch_size=8, seed=args.seed,
        )  # fmt: skip
        streams = domain_streams(eval_docs, tok)
        E = fp.cfg.moe.router.num_experts
        grid = default_grid(E)

        def score(model, streams=streams, seq_len=seq_len):
            r = evaluate(
                model, streams, seq_len=seq_len, batch_size=16, max_tokens=args.eval_tokens
            )
            return {k: v.bits_per_byte for k, v in r.per_domain.items()}, r.overall.bits_per_byte

        dom, overall = score(fp)
        n_exp = sum(b.experts.w_in.numel() + b.experts.w_down.numel() for b in moe_layers(fp))
        bits_fp = 8 * fp.blocks[0].ffn.experts.w_down.element_size()
        rows.append(dict(run=name, bits="fp", method="-", lowrank="-", target="-", per_domain=dom,
                         overall=overall, bits_per_param=bits_fp, lowrank_bytes=0, fused=None,
                         under=0, seconds=0.0))  # fmt: skip
        print(
            f"[{name}] fp32 overall {overall:.4f} bpb; {n_exp:,} expert weights; grid {grid}",
            flush=True,
        )
        hess = collect_hessians(fp, calib)
        speed_models = {}
        for bits in args.bits:
            for method in ("rtn", "gptq"):
                for scheme, target in [(s, t) for t in args.targets for s in SCHEMES]:
                    if scheme == "none" and target != args.targets[0]:
                        continue
                    if target == "B" and scheme not in args.b_schemes:
                        continue
                    t0 = time.time()
                    spec = QuantSpec(
                        method=method, bits=bits, group_size=args.group_size, symmetric=False,
                        act_order=method == "gptq", lowrank=scheme,
                        rank=0 if scheme == "none" else args.rank,
                        grid=grid if scheme == "tileq" else None,
                    )  # fmt: skip
                    cfg = QuantizeConfig(
                        spec=spec,
                        sequential=False,
                        seed=args.seed,
                        target=TARGETS[target],
                        weighting=args.weighting,
                    )
                    m = copy.deepcopy(fp)
                    reps = [
                        quantize_layer(layer, hess[i], cfg, i)
                        for i, layer in enumerate(moe_layers(m))
                    ]
                    dom, overall = score(m)
                    total = {}
                    for r in reps:
                        for k, v in r.bytes.items():
                            total[k] = total.get(k, 0) + v
                    weights = sum(r.weights for r in reps)
                    if scheme != "none" and scheme not in speed_models:  # shapes only matter
                        speed_models[scheme] = m
                    rows.append(dict(
                        run=name, bits=bits, method=method, lowrank=scheme,
                        target="-" if scheme == "none" else target, per_domain=dom,
                        overall=overall, bits_per_param=8 * sum(total.values()) / weights,
                        lowrank_bytes=total.get("lowrank", 0), fused=None,
                        under=sum(len(r.under_calibrated) for r in reps), seconds=time.time() - t0,
                    ))  # fmt: skip
                    print(
                        f"  {bits}b {method:4s} {scheme:10s} {overall:.4f} bpb ({time.time() - t0:.0f}s)",
                        flush=True,
                    )
        speeds = fused_speed(fp, calib, speed_models)
        for r in rows:
            if r["run"] == name and r["lowrank"] in speeds:
                r["fused"] = speeds[r["lowrank"]]
    print_table(rows)
    print(
        f"\ntotal wall time {time.time() - t_start:.0f}s (torch threads: {torch.get_num_threads()})"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def print_table(rows: list[dict]) -> None:
    domains = sorted({d for r in rows for d in r["per_domain"]})
    head = ["run", "bits", "method", "low-rank", "target", *[f"bpb {d}" for d in domains], "bpb all",
            "bits/param", "extra LR KiB", "fused x", "under-cal"]  # fmt: skip
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        cells = [r["run"], str(r["bits"]), r["method"], r["lowrank"], r["target"],
                 *[f"{r['per_domain'][d]:.4f}" for d in domains], f"{r['overall']:.4f}",
                 f"{r['bits_per_param']:.3f}", f"{r['lowrank_bytes'] / 1024:.1f}",
                 "-" if r["fused"] is None else f"{r['fused']:.2f}", str(r["under"])]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print("\nTileQ claim (>= 3x less extra memory than per-expert at the same rank, >= 70% of its")
    print("bits-per-byte improvement over plain quantization):")
    for run in dict.fromkeys(r["run"] for r in rows):
        for bits in dict.fromkeys(r["bits"] for r in rows if r["run"] == run and r["bits"] != "fp"):
            for method in ("rtn", "gptq"):
                for target in TARGETS:
                    sel = {r["lowrank"]: r for r in rows
                           if (r["run"], r["bits"], r["method"]) == (run, bits, method)
                           and r["target"] in ("-", target)}  # fmt: skip
                    if not {"none", "per-expert", "tileq"} <= set(sel):
                        continue
                    mem = sel["per-expert"]["lowrank_bytes"] / sel["tileq"]["lowrank_bytes"]
                    gain_pe = sel["none"]["overall"] - sel["per-expert"]["overall"]
                    gain_t = sel["none"]["overall"] - sel["tileq"]["overall"]
                    kept = gain_t / gain_pe if gain_pe > 0 else float("nan")
                    ok = mem >= 3 and kept >= 0.7
                    print(f"  {run} {bits}b {method} target {target}: memory {mem:.2f}x less, "
                          f"keeps {100 * kept:.0f}% of per-expert's gain ({gain_pe:+.4f} vs "
                          f"{gain_t:+.4f} bpb) -> {'holds' if ok else 'does NOT hold'}")  # fmt: skip


if __name__ == "__main__":
    main()
