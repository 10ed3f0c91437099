"""CaRE (ICML 2026) vs SimpleCIL, APER and sequential fine-tuning on a long class-incremental
stream: 54 tasks of 2 WordNet hypernym classes, frozen MiniLM-L6, 3 seeds.

Setting (``shared/research/wave3-continual.md`` §1.2; :mod:`moelab.methods.continual`): the
108 largest depth-5 hypernym classes of WordNet 3.0 (Debian ``wordnet-base``), 40 train / 10
test glosses per class, class order and split seeded, B0-Inc2 (54 tasks), task-agnostic test
over every seen class after every task. Adapters on the top 2 of 6 blocks, the lower 4 cached.
CaRE with the authors' long-sequence recipe (``iter_pred`` off, mean decay on), 10 epochs on
task 0 and 3 + 3 on later ones.

Metrics: Ā (mean of the accuracy curve), last accuracy, forgetting (PILOT), BWT; CaRE's router
hit rate (diagnostic). The claim checked (the note's calibration guess of "by a large
margin"): CaRE's last accuracy ≥ max(SimpleCIL, APER) + 2 points, mean of the seeds.

Usage::

    python benchmarks/care.py                          # 3 seeds (≈ 27 min alone on 2 cores)
    python benchmarks/care.py --tasks 6 --seeds 0      # a quick look
    python benchmarks/care.py --adapted-blocks 6 --arms care --seeds 0 --out runs/bench/care_all.json

Jobs (one per seed and arm group: CaRE; the three baselines) run over ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _pool import part_file, run_or_merge
from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.report import plot_curves, stream_extra
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_json, atomic_write_text
from moelab.utils.result_tables import paired_table, summary_table
from moelab.utils.results import make_result, write_result

ARMS = ("care", "simplecil", "aper", "finetune")
GROUPS = (("care",), ("finetune", "aper", "simplecil"))
MARGIN = 2.0


def _log(method: str, seed: int, t: int, T: int, acc: float) -> None:
    if (t + 1) % 9 == 0 or t + 1 == T:
        print(
            f"{time.strftime('%H:%M:%S')} {method} seed {seed}: task {t + 1}/{T}, A_t {acc:.1f}",
            flush=True,
        )


def _job(arms: tuple[str, ...], base: ContinualConfig, seed: int, parts: Path):
    """One seed of one arm group; its part is also written to ``parts`` as soon as it ends
    (so a run stopped early keeps the finished seeds: ``--merge``)."""
    recipe = ContinualRecipe(progress=_log)
    result = run_seeds(recipe, base, [seed], arms={a: {"method": a} for a in arms}, pairs=[])
    extra = {a: stream_extra(recipe.history[(a, seed)]) for a in arms}
    secs = {a: next(iter(v.values())) for a, v in result.extra["run_seconds"].items()}
    out = ({a: result.metrics[a][seed] for a in arms}, secs, extra)
    atomic_write_json(part_file(parts, arms, seed), out)
    return out


def verdict(result) -> dict:
    m, seeds = result.metrics, list(result.seeds)
    last = {a: float(np.mean([m[a][s]["last_acc"] for s in seeds])) for a in result.arms}
    best = max(("simplecil", "aper"), key=lambda a: last.get(a, -1.0))
    margin = last["care"] - last[best]
    return {
        "claim": f"last_acc(care) >= max(simplecil, aper) + {MARGIN}",
        "care_last": last["care"],
        "best_baseline": best,
        "best_baseline_last": last[best],
        "margin": margin,
        "holds": bool(margin >= MARGIN),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--tasks", type=int, default=54)
    p.add_argument("--adapted-blocks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="epochs on tasks >= 1 (default 6)")
    p.add_argument("--first-task-epochs", type=int, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/care.json"))
    p.add_argument(
        "--merge", action="store_true", help="build the result from the finished parts only"
    )
    args = p.parse_args()
    base = ContinualConfig(
        num_tasks=args.tasks,
        adapted_blocks=args.adapted_blocks,
        epochs=args.epochs or ContinualConfig.epochs,
        first_task_epochs=args.first_task_epochs or ContinualConfig.first_task_epochs,
    )
    start = time.perf_counter()
    parts = args.out.with_name(args.out.stem + "_parts")
    parts.mkdir(parents=True, exist_ok=True)
    groups = [tuple(a for a in g if a in args.arms) for g in GROUPS]
    # seed by seed, so a run cut short has whole seeds of every arm
    jobs = [(_job, (g, base, s, parts)) for s in args.seeds for g in groups if g]
    args.seeds, jobs, outs = run_or_merge(
        jobs, parts, args.seeds, merge=args.merge, workers=args.workers, threads=args.threads
    )
    arms = [a for a in ARMS if a in args.arms]
    metrics = {a: {} for a in arms}
    seconds = {a: {} for a in arms}
    curves = {a: {} for a in arms}
    for (_, (_, _, seed, _)), (met, sec, extra) in zip(jobs, outs, strict=True):
        for arm in met:
            metrics[arm][seed] = met[arm]
            seconds[arm][seed] = sec[arm]
            curves[arm][seed] = extra[arm]
    metrics = {a: {s: metrics[a][s] for s in args.seeds} for a in arms}
    wall = time.perf_counter() - start
    config = {
        "recipe": "care",
        "base": dataclasses.asdict(base),
        "arms": {a: {"method": a} for a in arms},
    }
    extra = {"run_seconds": seconds, "streams": curves, "wall_seconds": round(wall, 1)}
    result = make_result("care", "care", config, metrics, extra=extra)
    if "care" in arms and len(arms) > 1 and ("simplecil" in arms or "aper" in arms):
        result.extra["verdict"] = verdict(result)
    write_result(result, args.out)
    png = args.out.with_suffix(".png")
    plot_curves(
        {a: {s: curves[a][s]["curve"] for s in args.seeds} for a in arms},
        png,
        f"WordNet B0-Inc2, {args.tasks} tasks, MiniLM top-{args.adapted_blocks} adapted",
    )
    table = summary_table([result]) + "\n" + (paired_table([result]) if len(arms) > 1 else "")
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)
    print("verdict:", result.extra.get("verdict"))
    print(f"wall {wall:.0f} s; result {args.out}, plot {png}")


if __name__ == "__main__":
    main()
