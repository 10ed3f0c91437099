"""MoE vs its dense twin at the same wall-clock budget, on the same real data, in one run.

Each model first times a few training steps so that its cosine schedule ends exactly at the
budget; then it trains (``moelab.train.loop.train``) and the script prints the validation bits
per byte of both, overall and per domain. The dense twin has one SwiGLU FFN per layer whose
width matches the MoE's *active* parameters per token (``moelab.models.dense_twin``).

    python benchmarks/moe_vs_dense.py                  # 2 × 240 s on the mix corpus
    python benchmarks/moe_vs_dense.py --budget 60 --data shakespeare
"""

from __future__ import annotations

import argparse
import dataclasses
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budget", type=float, default=240.0, help="training seconds per model")
    ap.add_argument("--data", default="mix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the two runs here")
    args = ap.parse_args()

    base = TrainConfig(
        data=args.data, seed=args.seed, eval_every=10**9, checkpoint_every=0, log_every=10
    )
    tokenizer, train_stream, _ = prepare_data(base, None)
    moe_cfg = default_model_config()
    moe_cfg.vocab_size = tokenizer.vocab_size
    models = {"moe": moe_cfg, "dense twin": dense_twin_config(moe_cfg)}
    root = args.out or Path(tempfile.mkdtemp(prefix="moe_vs_dense_"))
    rows = []
    for name, cfg in models.items():
        t_step = seconds_per_step(cfg, base, train_stream)
        steps = max(10, int(args.budget / t_step))
        run_cfg = dataclasses.replace(
            base, steps=steps, warmup_steps=max(1, steps // 20), time_budget_s=args.budget * 1.15
        )
        result = train(
            dataclasses.replace(cfg), run_cfg, root / name.replace(" ", "_"), progress=False
        )
        params = count_params(MoETransformer(cfg))
        rows.append((name, params, result))
        print(
            f"{name}: {steps} steps in {result.elapsed_s:.0f} s, val bpb {result.final_eval.overall.bits_per_byte:.4f}"
        )

    domains = sorted(rows[0][2].final_eval.per_domain)
    print(
        f"\nMoE vs dense twin, {args.budget:.0f} s of training each, data={args.data}, seed={args.seed}"
    )
    head = (
        f"{'model':<11} {'params':>8} {'active':>8} {'steps':>6} {'tokens':>9} {'val bpb':>8} "
        + " ".join(f"{d:>11}" for d in domains)
    )
    print(head)
    for name, params, r in rows:
        ev = r.final_eval
        tokens = r.step * base.batch_size * base.seq_len
        print(
            f"{name:<11} {params['total'] / 1e6:7.2f}M {params['active_per_token'] / 1e6:7.2f}M {r.step:>6} "
            f"{tokens / 1e6:8.2f}M {ev.overall.bits_per_byte:8.4f} "
            + " ".join(f"{ev.per_domain[d].bits_per_byte:11.4f}" for d in domains)
        )
    moe_bpb, dense_bpb = (r.final_eval.overall.bits_per_byte for _, _, r in rows)
    print(
        f"\nMoE - dense: {moe_bpb - dense_bpb:+.4f} bits/byte ({'MoE lower' if moe_bpb < dense_bpb else 'dense lower'})"
    )


if __name__ == "__main__":
    main()
