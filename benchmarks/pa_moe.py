"""PA-MoE (arXiv 2602.17038): does phase routing beat one policy and other routing on a task mix?

Setting (``shared/research/wave3-agents-alignment.md`` §1.4; :mod:`moelab.methods.rl`):
MiniGrid, 75 % ``Empty-Random-5x5`` (simple) and 25 % ``DoorKey-5x5`` (complex: key → door →
goal), groups of 8 rollouts of 8 instances per iteration, PPO-clip on GiGPO advantages (or the
``--estimator`` given), a fixed frame budget per run, greedy evaluation on held-out seeds.

Arms: ``pamoe`` (phase router, one expert per step, switching cost), ``single`` (one expert of
the summed width: equal total parameters), ``step`` (token-choice top-1 router per step),
``trajectory`` (the phase router at t = 0, held all episode).

Metrics: greedy success per task, frames to 80 % DoorKey success (censored at the budget),
area under the DoorKey success curve, expert switches per episode and constant-expert run
length, NMI between expert and ground-truth DoorKey phase, learning curves. The claim checked:
PA-MoE's DoorKey success ≥ single + 5 points and ≥ both routing ablations, with ≤ 1/3 of the
step-level router's switches per episode. Paired differences per seed against the single policy
(and PA-MoE against each ablation) with seed-bootstrap percentile intervals.

Usage::

    python benchmarks/pa_moe.py                          # 3 seeds, 4 arms
    python benchmarks/pa_moe.py --frames 20000 --seeds 0 # a quick look

Jobs (one per arm and seed) run over ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from _pool import run_jobs
from moelab.methods.rl import PAMoERecipe, RLConfig
from moelab.methods.rl.envs import EnvPool
from moelab.methods.rl.io import checkpoint_frames, load_policy
from moelab.methods.rl.metrics import expert_shares
from moelab.methods.rl.plot import plot_learning_curves
from moelab.methods.rl.rollout import collect
from moelab.methods.rl.train import EVAL_SEED_BASE, build_run
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_text
from moelab.utils.results import make_result, write_result

ARMS = ("pamoe", "single", "step", "trajectory")
PAIRS = [
    ("pamoe", "single"),
    ("step", "single"),
    ("trajectory", "single"),
    ("pamoe", "step"),
    ("pamoe", "trajectory"),
]
MARGIN = 0.05
SWITCH_RATIO = 1 / 3
BOOTSTRAP = 10_000


def _job(arm: str, base: RLConfig, seed: int, ckpt: str | None) -> tuple[dict, dict]:
    result = run_seeds(PAMoERecipe(ckpt), base, [seed], arms={arm: {"arm": arm}}, pairs=[])
    return result.metrics[arm][seed], result.extra["run_seconds"][arm][str(seed)]


def _routing(arm: str, base: RLConfig, seed: int, folder: str) -> dict[str, list[float]]:
    """Expert shares per task and DoorKey phase of a finished run's greedy policy, on the
    first ``eval_episodes`` held-out seeds per task (a diagnostic of collapse and
    specialisation)."""
    config = dataclasses.replace(base, arm=arm)
    run = build_run(config, seed)
    load_policy(PAMoERecipe(folder).checkpoint(config, seed), run)
    n = config.eval_episodes
    slots = [(t, EVAL_SEED_BASE + k) for t in range(len(config.tasks)) for k in range(n)]
    r = collect(
        run.policy,
        run.mix,
        EnvPool(run.mix),
        slots,
        list(range(len(slots))),
        history=config.history,
        greedy=True,
        keep_history=False,
    )
    return expert_shares(r, run.mix.names, run.policy.num_experts)


def routing_table(routing: dict) -> str:
    """Markdown: per arm and seed, the expert shares (E entries, in %) per task and phase."""
    keys = sorted({k for per_seed in routing.values() for v in per_seed.values() for k in v})
    lines = ["| arm | seed | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for arm, per_seed in routing.items():
        for seed, shares in per_seed.items():
            cells = [
                " ".join(f"{100 * x:.0f}" for x in shares[k]) if k in shares else "" for k in keys
            ]
            lines.append(f"| {arm} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _finished_seeds(base: RLConfig, seeds: list[int], arms: list[str], folder) -> list[int]:
    if folder is None:
        raise SystemExit("--finished-only needs --checkpoint-dir")
    recipe = PAMoERecipe(folder)
    done = []
    for s in seeds:
        cfgs = [dataclasses.replace(base, arm=a) for a in arms]
        frames = [checkpoint_frames(recipe.checkpoint(c, s)) for c in cfgs]
        if all(f is not None and f >= base.frames for f in frames):
            done.append(s)
    if not done:
        raise SystemExit("no seed has finished every arm yet")
    return done


def bootstrap_ci(diffs: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of ``diffs`` over resamples of the seeds."""
    d = np.asarray(diffs)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), (BOOTSTRAP, len(d)))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _ms(values: list[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(np.mean(values), fmt)} ± {format(np.std(values, ddof=1), fmt)}"


def report(result) -> tuple[str, dict]:
    """The markdown tables and the claim's verdict."""
    seeds = list(result.seeds)
    m = result.metrics

    def vals(arm: str, name: str) -> list[float]:
        return [m[arm][s][name] for s in seeds]

    lines = [
        "| arm | Empty success | DoorKey success | frames to 80 % DoorKey (reached) | "
        "DoorKey AUC | switches / episode (DoorKey) | run length (DoorKey) | NMI expert–phase |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in result.arms:
        reached = int(sum(vals(arm, "reached_target")))
        frames_k = [f / 1000 for f in vals(arm, "frames_to_target")]
        lines.append(
            f"| {arm} | {_ms(vals(arm, 'success/empty'))} | {_ms(vals(arm, 'success/doorkey'))} "
            f"| {_ms(frames_k, '.0f')}k ({reached}/{len(seeds)}) | {_ms(vals(arm, 'auc'))} "
            f"| {_ms(vals(arm, 'switches/doorkey'), '.2f')} "
            f"| {_ms(vals(arm, 'run_length/doorkey'), '.1f')} | {_ms(vals(arm, 'nmi'))} |"
        )
    lines += [
        "",
        "| arm − baseline | metric | per seed | mean | 95 % seed-bootstrap interval |",
        "|---|---|---|---|---|",
    ]
    diffs = {}
    for arm, base in PAIRS:
        for name in ("success/doorkey", "success/empty", "switches/doorkey"):
            d = [a - b for a, b in zip(vals(arm, name), vals(base, name), strict=True)]
            lo, hi = bootstrap_ci(d)
            diffs[f"{arm}-{base}/{name}"] = {
                "per_seed": d,
                "mean": float(np.mean(d)),
                "ci": [lo, hi],
            }
            per = ", ".join(f"{x:+.3f}" for x in d)
            lines.append(
                f"| {arm} − {base} | {name} | {per} | {np.mean(d):+.3f} | [{lo:+.3f}, {hi:+.3f}] |"
            )
    mean = {a: float(np.mean(vals(a, "success/doorkey"))) for a in result.arms}
    sw = {a: float(np.mean(vals(a, "switches/doorkey"))) for a in result.arms}
    parts = {
        "doorkey >= single + 0.05": mean["pamoe"] >= mean["single"] + MARGIN,
        "doorkey >= step": mean["pamoe"] >= mean["step"],
        "doorkey >= trajectory": mean["pamoe"] >= mean["trajectory"],
        "switches <= step / 3": sw["pamoe"] <= SWITCH_RATIO * sw["step"],
    }
    verdict = {
        "parts": parts,
        "holds": all(parts.values()),
        "doorkey_mean": mean,
        "switches_mean": sw,
        "differences": diffs,
    }
    lines += ["", "| claim part | holds |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'no'} |" for k, v in parts.items()]
    lines.append(f"| **all** | **{'yes' if verdict['holds'] else 'no'}** |")
    return "\n".join(lines) + "\n", verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--frames", type=int, default=RLConfig.frames)
    p.add_argument("--eval-every", type=int, default=RLConfig.eval_every)
    p.add_argument("--eval-episodes", type=int, default=RLConfig.eval_episodes)
    p.add_argument("--final-episodes", type=int, default=RLConfig.final_episodes)
    p.add_argument("--estimator", default="gigpo", choices=("gigpo", "grpo", "gae"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="resumable per-run checkpoints (a rerun resumes)",
    )
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="with --checkpoint-dir: report only the seeds whose runs have all finished "
        "(a partial result while the others still train)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench/pa-moe.json"))
    args = p.parse_args()
    base = RLConfig(
        frames=args.frames,
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        final_episodes=args.final_episodes,
        estimator=args.estimator,
    )
    start = time.perf_counter()
    ckpt = None if args.checkpoint_dir is None else str(args.checkpoint_dir)
    if args.finished_only:
        args.seeds = _finished_seeds(base, args.seeds, args.arms, args.checkpoint_dir)
    jobs = [(_job, (arm, base, s, ckpt)) for s in args.seeds for arm in args.arms]
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics = {arm: {} for arm in args.arms}
    seconds = {arm: {} for arm in args.arms}
    for (_, (arm, _, seed, _)), (met, sec) in zip(jobs, outs, strict=True):
        metrics[arm][seed] = met
        seconds[arm][str(seed)] = sec
    settings = {
        "recipe": "pa-moe",
        "finished_only": args.finished_only,
        "base": dataclasses.asdict(base),
        "arms": {a: {"arm": a} for a in args.arms},
        "workers": args.workers,
        "threads": args.threads,
    }
    routing = {}
    if ckpt is not None:
        routing_jobs = [(_routing, (arm, base, s, ckpt)) for arm in args.arms for s in args.seeds]
        shares = run_jobs(routing_jobs, args.workers, args.threads)
        for (_, (arm, _, seed, _)), sh in zip(routing_jobs, shares, strict=True):
            routing.setdefault(arm, {})[str(seed)] = sh
    pairs = [pr for pr in PAIRS if pr[0] in args.arms and pr[1] in args.arms]
    result = make_result("pa-moe", "pa-moe", settings, metrics, pairs=pairs)
    elapsed = time.perf_counter() - start
    table, verdict = report(result) if set(ARMS) <= set(args.arms) else ("", {})
    result = dataclasses.replace(
        result,
        extra={
            "run_seconds": seconds,
            "wall_seconds": elapsed,
            "claim": verdict,
            "expert_shares": routing,
        },
    )
    write_result(result, args.out)
    plot = plot_learning_curves(result, args.out.with_suffix(".png"))
    if routing:
        table += "\nExpert shares (%) per task and DoorKey phase, greedy policy:\n\n"
        table += routing_table(routing)
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)
    print(
        f"wall time {elapsed / 60:.1f} min ({math.ceil(elapsed)} s); result: {args.out}; "
        f"curves: {plot}"
    )


if __name__ == "__main__":
    main()
