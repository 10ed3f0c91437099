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

from _finish import finish, mean_sd
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
PAIRS = [("come", "token_moe"), ("come", "come_no_rft"), ("come", "dense"), ("come_dpo", "come")]
PAIRED_METRICS = ["action_match", "action_type", "alignment", "online_success"]
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
            cells.append(mean_sd(vals) if vals else "—")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")

    def mean(arm: str, name: str) -> float:
        return float(np.mean([m[arm][s][name] for s in seeds]))

    def diffs(base: str) -> list[float]:
        return [m["come"][s]["action_match"] - m[base][s]["action_match"] for s in seeds]

    verdicts: dict = {}
    lines += ["", "| claim | measured (per seed) | holds |", "|---|---|---|"]
    for key, base, margin, text in (
        ("come_vs_token_moe", "token_moe", MARGIN, "action match: CoME ≥ token-MoE"),
        ("router_ft_ablation", "come_no_rft", NO_RFT_MARGIN, "CoME ≥ CoME w/o Router-FT"),
    ):
        if base not in m:
            continue
        d = diffs(base)
        verdicts[key] = {
            "diff_per_seed": d,
            "mean_diff": float(np.mean(d)),
            "holds": bool(np.mean(d) >= margin),
        }
        per = ", ".join(f"{x:+.3f}" for x in d)
        lines.append(
            f"| {text} + {margin:.2f} | {np.mean(d):+.3f} ({per}) | "
            f"{'yes' if verdicts[key]['holds'] else 'no'} |"
        )
    if "token_moe" in m:
        come_a, tok_a = mean("come", "alignment"), mean("token_moe", "alignment")
        holds = come_a >= 0.95 and tok_a <= 0.40
        verdicts["alignment"] = {"come": come_a, "token_moe": tok_a, "holds": bool(holds)}
        lines.append(
            f"| alignment: CoME ≥ 0.95, token-MoE ≤ 0.40 | {come_a:.3f}, {tok_a:.3f} | "
            f"{'yes' if holds else 'no'} |"
        )
    return "\n".join(lines) + "\n", verdicts


def _from_progress(log: Path, settings: dict, seeds: list[int], out: Path) -> None:
    """The result of an interrupted run from its progress log: the arms finished for every
    seed (``settings["partial"]`` lists the arms left out)."""
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    done: dict = {}
    for r in rows:
        done.setdefault(r["arm"], {})[r["seed"]] = r["metrics"]
    arms = [a for a in settings["arms"] if set(seeds) <= set(done.get(a, {}))]
    if "come" not in arms:
        raise SystemExit(f"{log}: the come arm has not finished for seeds {seeds}")
    metrics = {a: {s: done[a][s] for s in seeds} for a in arms}
    settings = {**settings, "partial": [a for a in settings["arms"] if a not in arms]}
    pairs = [p for p in PAIRS if p[0] in arms and p[1] in arms]
    finish(
        "come",
        settings,
        metrics,
        pairs,
        report,
        seconds={},
        elapsed=0.0,
        out=out,
        paired_metrics=PAIRED_METRICS,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="a tenth of the steps: a look")
    p.add_argument("--dpo", action="store_true", help="add the CoME + Info-DPO arm")
    p.add_argument("--online", type=int, default=0, help="browser episodes per task (0: none)")
    p.add_argument("--eval-steps", type=int, default=320, help="held-out steps scored")
    p.add_argument(
        "--from-progress",
        type=Path,
        default=None,
        help="render the result of an interrupted run from its .progress.jsonl",
    )
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
    settings = {
        "recipe": "come",
        "base": dataclasses.asdict(base),
        "arms": arms,
        "quick": args.quick,
        "small": args.small,
        "workers": args.workers,
        "threads": args.threads,
    }
    if args.from_progress is not None:
        _from_progress(args.from_progress, settings, args.seeds, args.out)
        return
    start = time.perf_counter()
    log = args.out.with_suffix(".progress.jsonl")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    jobs = [(_seed_arms, (base, arms, log, s)) for s in args.seeds]
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics, seconds = merge_seed_runs(jobs, outs, list(arms), args.seeds)
    finish(
        "come",
        settings,
        metrics,
        [p for p in PAIRS if p[0] in arms],
        report,
        seconds=seconds,
        elapsed=time.perf_counter() - start,
        out=args.out,
        paired_metrics=PAIRED_METRICS,
    )


if __name__ == "__main__":
    main()
