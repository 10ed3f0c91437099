"""CKA-guided selective upcycling (ICML 2026 poster 64571) vs full upcycling and sequential
fine-tuning with replay on "TRACE-lite": 5 task-incremental text tasks on MiniLM-L6, 3 seeds.

Setting (``shared/research/wave3-continual.md`` §5.2; :mod:`moelab.methods.continual.upcycling`):
the five real text domains (WordNet noun and verb supersenses, fortune categories, KJV genres,
stdlib modules; 78 classes), one task per domain in a seeded order, the task given at test
(per-task heads). Every one of the 6 MiniLM blocks is a candidate growth site (only the
embeddings are cached). Per task ``--steps`` Adam steps of ``batch_size`` task texts plus
replay; the selective arm spends 2/3 of them searching with the Gumbel mask.

Metrics: OP (mean final accuracy = last accuracy), BWT (Lopez-Paz), forgetting = −BWT (and
PILOT's max-based forgetting), expert parameters added and their share of full upcycling's,
which sites grew, per-layer CKA between a probe set's features before and after each task.
The claim checked (the research spec's, 3 seeds): selective adds ≤ 50 % of full upcycling's
expert parameters, its OP ≥ full upcycling's − 1 point, and its forgetting (−BWT) is ≥ 30 %
lower than SeqFT+replay's.

Usage::

    python benchmarks/selective_upcycling.py                       # 3 seeds (25 min on 2 shared cores)
    python benchmarks/selective_upcycling.py --seeds 0 --steps 6   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _pool import run_jobs
from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.report import stream_extra
from moelab.methods.continual.upcycling_settings import UpcyclingSettings
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from moelab.utils.jsonfile import read_json
from moelab.utils.result_tables import paired_table, summary_table
from moelab.utils.results import make_result, write_result

ARMS = ("selective-upcycling", "full-upcycling", "seqft-replay")
KEYS = ("metrics", "seconds", "streams", "upcycling")


def _log(method: str, seed: int, t: int, T: int, acc: float) -> None:
    print(
        f"{time.strftime('%H:%M:%S')} {method} seed {seed}: task {t + 1}/{T}, A_t {acc:.1f}",
        flush=True,
    )


def verdict(metrics: dict, seeds: list[int]) -> dict:
    def mean(arm: str, key: str) -> float:
        return float(np.mean([metrics[arm][s][key] for s in seeds]))

    growth = mean("selective-upcycling", "growth_vs_full")
    op_sel, op_full = mean("selective-upcycling", "last_acc"), mean("full-upcycling", "last_acc")
    fg_sel, fg_seq = -mean("selective-upcycling", "bwt"), -mean("seqft-replay", "bwt")
    reduction = 100.0 * (1.0 - fg_sel / fg_seq) if fg_seq > 0 else float("nan")
    return {
        "claim": "growth <= 50% of full, OP >= full - 1, forgetting (-BWT) >= 30% below SeqFT+replay",
        "selective_growth_pct_of_full": growth,
        "op_selective": op_sel,
        "op_full": op_full,
        "forgetting_selective": fg_sel,
        "forgetting_seqft_replay": fg_seq,
        "forgetting_reduction_pct": reduction,
        "growth_holds": bool(growth <= 50.0),
        "op_holds": bool(op_sel >= op_full - 1.0),
        "forgetting_holds": bool(fg_seq > 0 and reduction >= 30.0),
        "holds": bool(
            growth <= 50.0 and op_sel >= op_full - 1.0 and fg_seq > 0 and reduction >= 30.0
        ),
    }


def plot(result, details: dict, path: Path) -> None:
    """Accuracy curves, per-layer CKA (before vs after each task, mean over tasks and seeds)
    and how often the selective arm grew each layer, in one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    seeds = list(result.seeds)
    fig = Figure(figsize=(15.0, 4.2))
    FigureCanvasAgg(fig)
    ax_acc, ax_cka, ax_grow = fig.subplots(1, 3)
    for arm in ARMS:
        m = np.array([result.extra["streams"][arm][str(s)]["curve"] for s in seeds])
        x = np.arange(1, m.shape[1] + 1)
        ax_acc.plot(x, m.mean(0), marker="o", label=arm)
        c = np.array([details[arm][str(s)]["cka"] for s in seeds])  # [seeds, T, L]
        layers = np.arange(c.shape[2]) + details[arm][str(seeds[0])]["first_block"]
        ax_cka.plot(layers, c.mean((0, 1)), marker="o", label=arm)
    g = np.array([details["selective-upcycling"][str(s)]["growth"] for s in seeds])
    ax_grow.bar(layers, 100.0 * g.mean((0, 1)))
    ax_acc.set(xlabel="tasks learned", ylabel="A_t, mean over seeds (%)", title="accuracy")
    ax_cka.set(
        xlabel="block",
        ylabel="linear CKA(before task, after task)",
        title="representation change per layer (mean over tasks)",
    )
    ax_grow.set(
        xlabel="block",
        ylabel="% of (task, seed) grown",
        ylim=(0, 100),
        title="selective: layers grown",
    )
    for ax in (ax_acc, ax_cka):
        ax.grid(alpha=0.3)
        ax.legend()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def _job(base: ContinualConfig, seed: int, arms: tuple[str, ...], parts: Path) -> dict:
    """``arms`` on one seed, merged into the seed's part in ``parts`` (the other arms' entries
    are kept) and written as soon as it ends (``--merge`` builds a result from the finished
    seeds of a run stopped early; ``--arms`` reruns some arms only)."""
    recipe = ContinualRecipe(progress=_log)
    part = run_seeds(recipe, base, [seed], arms={a: {"method": a} for a in arms}, pairs=[])
    path = parts / f"seed{seed}.json"
    out = read_json(path) if path.is_file() else {k: {} for k in KEYS}
    for a in arms:
        out["metrics"][a] = part.metrics[a][seed]
        out["seconds"][a] = recipe.seconds[(a, seed)]
        out["streams"][a] = stream_extra(recipe.history[(a, seed)])
        out["upcycling"][a] = recipe.details[(a, seed)]
    atomic_write_json(path, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=24, help="inner steps per task (every arm)")
    p.add_argument("--train-per-class", type=int, default=8)
    p.add_argument("--test-per-class", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--replay-batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=3, help="seeds run side by side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/results/cka_upcycling.json"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="arms to run")
    p.add_argument("--merge", action="store_true", help="build the result from finished seeds")
    args = p.parse_args()
    base = ContinualConfig(
        stream="domains",
        scenario="task",
        method="selective-upcycling",
        adapted_blocks=6,
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        upcycling=UpcyclingSettings(
            steps=args.steps, replay_batch=args.replay_batch, outer_every=4, probe_size=32
        ),
    )
    start = time.perf_counter()
    parts = args.out.with_name(args.out.stem + "_parts")
    parts.mkdir(parents=True, exist_ok=True)
    if args.merge:
        found = {s: parts / f"seed{s}.json" for s in args.seeds}
        args.seeds = [s for s, f in found.items() if f.is_file()]
        outs = [read_json(found[s]) for s in args.seeds]
    else:
        arms = tuple(args.arms)
        jobs = [(_job, (base, s, arms, parts)) for s in args.seeds]
        outs = run_jobs(jobs, args.workers, args.threads)
    seeds = args.seeds
    metrics = {a: {s: o["metrics"][a] for s, o in zip(seeds, outs, strict=True)} for a in ARMS}
    extra = {
        key: {a: {str(s): o[key][a] for s, o in zip(seeds, outs, strict=True)} for a in ARMS}
        for key in KEYS[1:]
    }
    extra["run_seconds"] = extra.pop("seconds")
    extra["wall_seconds"] = round(time.perf_counter() - start, 1)
    config = {
        "recipe": "continual",
        "base": dataclasses.asdict(base),
        "arms": {a: {"method": a} for a in ARMS},
    }
    result = make_result("selective_upcycling", "continual", config, metrics, extra=extra)
    result.extra["verdict"] = verdict(metrics, seeds)
    write_result(result, args.out)
    plot(result, extra["upcycling"], args.out.with_suffix(".png"))
    table = summary_table([result]) + "\n" + paired_table([result])
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)
    print("verdict:", result.extra["verdict"])
    print(f"wall {time.perf_counter() - start:.0f} s; result {args.out}")


if __name__ == "__main__":
    main()
