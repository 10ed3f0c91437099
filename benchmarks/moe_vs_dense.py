"""MoE vs its dense twin at equal wall-clock budgets, on the same real data, in one run.

Each model first times a few training steps so that its cosine schedule ends exactly at the
budget; then it trains (``moelab.train.loop.train``) and the script prints the validation bits
per byte of both, overall and per domain. The dense twin has one SwiGLU FFN per layer whose
width matches the MoE's *active* parameters per token (``moelab.models.dense_twin``).

Learning rates: at the first budget every model trains once per ``--lrs`` value and keeps
its best (lowest validation bits/byte); the later budgets reuse each model's own best. The
dense twin is never run at the MoE's rate by default. ``--experts/--top-k/--expert-ffn``
change the MoE (and so its twin) from the ``moelab train`` default.

    python benchmarks/moe_vs_dense.py                                  # 2 × 240 s, mix corpus
    python benchmarks/moe_vs_dense.py --budgets 120 240 480 --lrs 1e-3 2e-3 4e-3 --json out.json
    python benchmarks/moe_vs_dense.py --budgets 60 --data shakespeare
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from moelab.data import sample_batch
from moelab.models import MoETransformer, count_params, dense_twin_config
from moelab.train.config import TrainConfig
from moelab.train.loop import prepare_data, train
from moelab.train.presets import default_model_config


def seconds_per_step(model_cfg, cfg: TrainConfig, train_stream, probe_steps: int = 4) -> float:
    """Median wall time of one optimizer step (forward, backward, AdamW) after one warm-up."""
    torch.manual_seed(cfg.seed)
    model = MoETransformer(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    times = []
    for _ in range(probe_steps + 1):
        batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, gen)
        t = time.perf_counter()
        for _ in range(cfg.grad_accum):
            model.loss(batch.input_ids, batch.targets).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


def run_one(name, model_cfg, base, train_stream, budget, lr, root) -> dict:
    """Train ``model_cfg`` for ``budget`` seconds at ``lr``; the result row."""
    cfg = dataclasses.replace(base, lr=lr)
    t_step = seconds_per_step(model_cfg, cfg, train_stream)
    steps = max(10, int(budget / t_step))
    run_cfg = dataclasses.replace(
        cfg, steps=steps, warmup_steps=max(1, steps // 20), time_budget_s=budget * 1.15
    )
    out = root / f"{name.replace(' ', '_')}-{budget:g}s-lr{lr:g}"
    result = train(dataclasses.replace(model_cfg), run_cfg, out, progress=False)
    ev = result.final_eval
    params = count_params(MoETransformer(model_cfg))
    row = {
        "model": name,
        "budget_s": budget,
        "lr": lr,
        "params": params["total"],
        "active": params["active_per_token"],
        "steps": result.step,
        "elapsed_s": result.elapsed_s,
        "tokens": result.step * base.batch_size * base.seq_len,
        "val_bpb": ev.overall.bits_per_byte,
        "per_domain": {d: v.bits_per_byte for d, v in ev.per_domain.items()},
    }
    print(
        f"{name:<11} {budget:5.0f} s  lr {lr:g}: {result.step} steps in {result.elapsed_s:.0f} s, "
        f"val bpb {row['val_bpb']:.4f}",
        flush=True,
    )
    return row


def print_table(rows: list[dict], best: dict) -> None:
    domains = sorted(rows[0]["per_domain"])
    print(
        f"\n{'budget':>6} {'model':<11} {'lr':>7} {'params':>8} {'active':>8} {'steps':>6} "
        f"{'tokens':>8} {'val bpb':>8} " + " ".join(f"{d:>11}" for d in domains)
    )
    for r in rows:
        mark = "*" if best.get((r["budget_s"], r["model"])) is r else " "
        print(
            f"{r['budget_s']:5.0f}s {r['model']:<11} {r['lr']:7.1e} {r['params'] / 1e6:7.2f}M "
            f"{r['active'] / 1e6:7.2f}M {r['steps']:>6} {r['tokens'] / 1e6:7.2f}M "
            f"{r['val_bpb']:8.4f}{mark}" + " ".join(f"{r['per_domain'][d]:11.4f}" for d in domains)
        )
    print("(* = the model's best learning rate at that budget)")
    for budget in sorted({r["budget_s"] for r in rows}):
        moe, dense = best[(budget, "moe")], best[(budget, "dense twin")]
        gap = dense["val_bpb"] - moe["val_bpb"]
        print(
            f"{budget:5.0f} s: MoE {moe['val_bpb']:.4f} vs dense {dense['val_bpb']:.4f}: "
            f"MoE ahead by {gap:+.4f} bits/byte"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budgets", type=float, nargs="+", default=[240.0],
                    help="training seconds per model, one comparison per budget")  # fmt: skip
    ap.add_argument("--lrs", type=float, nargs="+", default=None,
                    help="learning rates tried by each model at the first budget (default: the preset's)")  # fmt: skip
    ap.add_argument("--experts", type=int, default=None, help="MoE experts (default: preset)")
    ap.add_argument("--top-k", type=int, default=None, help="MoE top-k (default: preset)")
    ap.add_argument("--expert-ffn", type=int, default=None, help="expert FFN width (default: preset)")  # fmt: skip
    ap.add_argument("--data", default="mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    args = ap.parse_args()

    base = TrainConfig(
        data=args.data, seed=args.seed, eval_every=10**9, checkpoint_every=0, log_every=10
    )
    tokenizer, train_stream, _ = prepare_data(base, None)
    moe_cfg = default_model_config()
    moe_cfg.vocab_size = tokenizer.vocab_size
    router, experts = moe_cfg.moe.router, moe_cfg.moe.experts
    if args.experts is not None:
        router.num_experts = args.experts
    if args.top_k is not None:
        router.top_k = args.top_k
    if args.expert_ffn is not None:
        experts.ffn_hidden_size = args.expert_ffn
    models = {"moe": moe_cfg, "dense twin": dense_twin_config(moe_cfg)}
    root = args.out or Path(tempfile.mkdtemp(prefix="moe_vs_dense_"))
    lrs = args.lrs or [base.lr]
    rows: list[dict] = []
    best: dict = {}
    for i, budget in enumerate(args.budgets):
        for name, cfg in models.items():
            tried = lrs if i == 0 else [best[(args.budgets[0], name)]["lr"]]
            mine = [run_one(name, cfg, base, train_stream, budget, lr, root) for lr in tried]
            best[(budget, name)] = min(mine, key=lambda r: r["val_bpb"])
            rows += mine
        print_table(rows, best)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(f"\nMoE vs dense twin, data={args.data}, seed={args.seed}, runs in {root}")


if __name__ == "__main__":
    main()
