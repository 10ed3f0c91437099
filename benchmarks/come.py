"""CoME (arXiv 2602.24142): do stage experts beat a token-routed MoE on GUI-agent chains?
Four arms (plus Info-DPO), 3 seeds, one table.

Setting (``shared/research/wave3-agents-alignment.md`` §3.3-3.4; :mod:`moelab.methods.agents`):
the shipped MiniWoB++ chains (8 tasks × 300 episodes from scripted oracles in headless
Chromium, four stages per step in AITZ's CoAT format); the 50 highest-seed episodes of each
task held out. A dense LM (d 128, 4 layers, SwiGLU 512, BPE 1024) warmed up on the chains,
shared by a seed's arms, then:

* ``dense``: the warm-up model trained on (equal active parameters);
* ``token_moe``: upcycled to 4 experts, learned input-oriented top-1 router, Switch balance
  loss (equal total and active parameters);
* ``come``: Expert-FT (forced stage routing) → Router-FT (routers only) → CoT-FT;
* ``come_no_rft``: without the Router-FT phase (the paper's ablation);
* ``come_dpo`` (optional, ``--dpo``): ``come`` then Info-DPO.

Metrics on held-out steps: action match (type and function), action type, per-stage exact
match, router–stage alignment (teacher-forced), online success in the browser (``--online N``
episodes per task, where Chromium and miniwob exist). Claims checked (mean of the seeds):

1. action_match(come) ≥ action_match(token_moe) + 0.03;
2. alignment(come) ≥ 0.95 and alignment(token_moe) ≤ 0.40;
3. action_match(come) − action_match(come_no_rft) ≥ 0.02.

Usage::

    python benchmarks/come.py                         # 3 seeds, 4 arms
    python benchmarks/come.py --dpo --online 10       # + Info-DPO, + 10 browser episodes/task
    python benchmarks/come.py --quick --seeds 0       # a quick look
    python benchmarks/come.py --small                 # d 64: for a crowded CPU

Jobs (one per seed: its arms share the seed's dense warm-up) run over ``--workers``
processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from _finish import finish
from _pool import merge_seed_runs, run_jobs
from moelab.methods.agents import ComeConfig, ComeRecipe
from moelab.methods.runner import run_seeds

# run in this order inside a seed: the claims' arms first (partial figures are usable)
ARMS = {
    "come": {"arm": "come"},
    "token_moe": {"arm": "token_moe"},
    "come_no_rft": {"arm": "come_no_rft"},
    "dense": {"arm": "dense"},
}
DPO_ARM = {"come_dpo": {"arm": "come", "dpo": "info"}}
PAIRS = [("come", "token_moe"), ("come", "come_no_rft"), ("come", "dense")]
MARGIN, NO_RFT_MARGIN = 0.03, 0.02
COLUMNS = (
    "action_match",
    "action_type",
    "em/summary",
    "em/subtask",
    "em/decision",
    "em/function",
    "alignment",
    "online_success",
)


def _seed_arms(base: ComeConfig, arms: dict, log: Path, seed: int) -> tuple[dict, dict]:
    """Every arm of one seed in one process (one recipe: they share the data and the seed's
    warm-up); each arm's metrics are appended to ``log`` as it finishes (partial figures)."""
    recipe = ComeRecipe()
    metrics, seconds = {}, {}
    for arm, over in arms.items():
        result = run_seeds(recipe, base, [seed], arms={arm: over}, pairs=[])
        metrics.update(result.metrics)
        seconds.update(result.extra["run_seconds"])
        line = {"seed": seed, "arm": arm, "metrics": result.metrics[arm][seed]}
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    return metrics, seconds


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def report(result) -> tuple[str, dict]:
    """The markdown table and the claim verdicts of a merged result."""
    seeds = list(result.seeds)
    m = result.metrics
    cols = [c for c in COLUMNS if any(c in m[a][s] for a in result.arms for s in seeds)]
    lines = ["| arm | " + " | ".join(cols) + " |", "|" + "---|" * (1 + len(cols))]
    for arm in result.arms:
        cells = []
        for c in cols:
            vals = [m[arm][s][c] for s in seeds if c in m[arm][s]]
            cells.append(_mean_sd(vals) if vals else "—")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")

    def mean(arm: str, name: str) -> float:
        return float(np.mean([m[arm][s][name] for s in seeds]))

    d_tok = [m["come"][s]["action_match"] - m["token_moe"][s]["action_match"] for s in seeds]
    d_rft = [m["come"][s]["action_match"] - m["come_no_rft"][s]["action_match"] for s in seeds]
    verdicts = {
        "come_vs_token_moe": {
            "diff_per_seed": d_tok,
            "mean_diff": float(np.mean(d_tok)),
            "holds": bool(np.mean(d_tok) >= MARGIN),
        },
        "alignment": {
            "come": mean("come", "alignment"),
            "token_moe": mean("token_moe", "alignment"),
            "holds": bool(
                mean("come", "alignment") >= 0.95 and mean("token_moe", "alignment") <= 0.40
            ),
        },
        "router_ft_ablation": {
            "diff_per_seed": d_rft,
            "mean_diff": float(np.mean(d_rft)),
            "holds": bool(np.mean(d_rft) >= NO_RFT_MARGIN),
        },
    }
    v = verdicts
    lines += [
        "",
        "| claim | measured (per seed) | holds |",
        "|---|---|---|",
        f"| action match: CoME ≥ token-MoE + {MARGIN:.2f} | "
        f"{v['come_vs_token_moe']['mean_diff']:+.3f} ({', '.join(f'{d:+.3f}' for d in d_tok)}) | "
        f"{'yes' if v['come_vs_token_moe']['holds'] else 'no'} |",
        f"| alignment: CoME ≥ 0.95, token-MoE ≤ 0.40 | {v['alignment']['come']:.3f}, "
        f"{v['alignment']['token_moe']:.3f} | {'yes' if v['alignment']['holds'] else 'no'} |",
        f"| Router-FT: CoME ≥ CoME w/o Router-FT + {NO_RFT_MARGIN:.2f} | "
        f"{v['router_ft_ablation']['mean_diff']:+.3f} ({', '.join(f'{d:+.3f}' for d in d_rft)}) | "
        f"{'yes' if v['router_ft_ablation']['holds'] else 'no'} |",
    ]
    return "\n".join(lines) + "\n", verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="a tenth of the steps: a look")
    p.add_argument("--dpo", action="store_true", help="add the CoME + Info-DPO arm")
    p.add_argument("--online", type=int, default=0, help="browser episodes per task (0: none)")
    p.add_argument("--eval-steps", type=int, default=320, help="held-out steps scored")
    p.add_argument(
        "--small", action="store_true", help="d 64, SwiGLU 256: a quarter of the compute per step"
    )
    for name in ("warmup_steps", "expert_steps", "router_steps", "cot_steps"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/come.json"))
    args = p.parse_args()
    base = ComeConfig(eval_steps=args.eval_steps, online_episodes=args.online)
    if args.small:
        base = dataclasses.replace(base, d_model=64, ffn_size=256)
    steps = {
        n: getattr(args, n)
        for n in ("warmup_steps", "expert_steps", "router_steps", "cot_steps")
        if getattr(args, n) is not None
    }
    base = dataclasses.replace(base, **steps)
    if args.quick:
        base = dataclasses.replace(
            base, warmup_steps=60, expert_steps=20, router_steps=10, cot_steps=20, eval_steps=64
        )
    arms = {**ARMS, **(DPO_ARM if args.dpo else {})}
    start = time.perf_counter()
    log = args.out.with_suffix(".progress.jsonl")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    jobs = [(_seed_arms, (base, arms, log, s)) for s in args.seeds]
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics, seconds = merge_seed_runs(jobs, outs, list(arms), args.seeds)
    settings = {
        "recipe": "come",
        "base": dataclasses.asdict(base),
        "arms": arms,
        "quick": args.quick,
        "workers": args.workers,
        "threads": args.threads,
    }
    finish(
        "come",
        settings,
        metrics,
        PAIRS,
        report,
        seconds=seconds,
        elapsed=time.perf_counter() - start,
        out=args.out,
        paired_metrics=["action_match", "action_type", "alignment"],
    )


if __name__ == "__main__":
    main()
