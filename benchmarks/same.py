"""SAME (ICML 2026) vs MoELoRA and sequential LoRA on "text-MCIT": continual instruction tuning
of a frozen MiniLM-L6 on 5 real text tasks with one shared answer vocabulary, 3 seeds.

Setting (``shared/research/wave3-continual.md`` §3.2; :mod:`moelab.methods.continual.same`):
the five domains of :mod:`moelab.methods.continual.domains` (WordNet noun and verb
supersenses, fortune topics, KJV parts, stdlib modules; 78 answers), task order seeded, 20
train / 8 test texts per class, each text ``"{instruction paraphrase} [SEP] {input}"``, the
answer scored by cosine to the frozen embedding of ``"answer: {label prompt}"`` among all 78.
MoE-LoRA (E = 5, r = 20, α = 40) on the FFN linears of blocks 3–5, blocks 0–2 cached; AdamW
2e-3, cosine with 3 % warm-up, 2 epochs per task, batch 16.

Arms: SAME (stabilisers + task prior), SAME without the prior (the same trained weights routed
with π uniform: one extra evaluation), MoELoRA, sequential LoRA. Metrics from the 5×5 matrix
R[t, j]: ``last`` = mean_j R[T−1, j], ``avg`` = mean_t mean_{j<=t} R[t, j], ``bwt`` (Lopez-Paz);
``router_drift`` (mean total variation of task 1's routing after task 1 vs after task 5) and
``route_stability`` (top-1 agreement). The claim checked: SAME's Last >= MoELoRA's + 3 points
(mean of the seeds); if SAME without the prior does not clear it, the stabilisers alone did not
reproduce.

Usage::

    python benchmarks/same.py                    # 3 seeds, every arm
    python benchmarks/same.py --seeds 0 --train-per-class 6 --out runs/bench/same_quick.json

Jobs (one per seed and trained arm) run over ``--workers`` processes; each worker keeps its
encoder and prefix cache across its jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _pool import part_file, run_or_merge
from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.loop import run_stream
from moelab.methods.runner import seed_everything
from moelab.utils.atomic import atomic_write_json, atomic_write_text
from moelab.utils.result_tables import paired_table, summary_table
from moelab.utils.results import make_result, write_result

TRAINED = ("same", "moelora", "seqlora")
ARMS = ("same", "same_noprior", "moelora", "seqlora")
PAIRS = [
    ("same", "moelora"),
    ("same", "same_noprior"),
    ("same", "seqlora"),
    ("same_noprior", "moelora"),
]
METRICS = ("last", "avg", "bwt", "router_drift", "route_stability")
MARGIN = 3.0
_RECIPE: ContinualRecipe | None = None


def _log(method: str, seed: int, t: int, T: int, acc: float) -> None:
    print(f"{time.strftime('%H:%M:%S')} {method} seed {seed}: task {t + 1}/{T}", flush=True)


def matrix_metrics(R: np.ndarray) -> dict[str, float]:
    """``last``, ``avg`` (unweighted task means) and ``bwt`` of a full ``[T, T]`` matrix."""
    T = R.shape[0]
    return {
        "last": float(R[-1].mean()),
        "avg": float(np.mean([R[t, : t + 1].mean() for t in range(T)])),
        "bwt": float(np.mean([R[-1, j] - R[j, j] for j in range(T - 1)])) if T > 1 else 0.0,
    }


def _job(arm: str, base: ContinualConfig, seed: int, parts: Path) -> dict:
    """One seed of one trained arm → ``{arm: (metrics, R rows)}`` (SAME also gives
    ``same_noprior``); written to ``parts`` as soon as it ends."""
    global _RECIPE
    _RECIPE = _RECIPE or ContinualRecipe()
    config = dataclasses.replace(base, method=arm)
    seed_everything(seed)  # the learner draws its initial weights from the global generator
    learner = _RECIPE.learner(config, seed)
    t0 = time.perf_counter()
    result = run_stream(
        learner, progress=lambda t, a: _log(arm, seed, t, learner.stream.num_tasks, a)
    )
    secs = time.perf_counter() - t0
    extra = learner.stream_metrics()
    out = {
        arm: (
            {
                **matrix_metrics(result.R),
                **{k: v for k, v in extra.items() if not k.startswith("noprior_")},
                "seconds": secs,
            },
            result.R.tolist(),
        )
    }
    if arm == "same":
        drift = {
            k[len("noprior_") :]: extra[k]
            for k in ("noprior_router_drift", "noprior_route_stability")
            if k in extra
        }
        out["same_noprior"] = (
            {**matrix_metrics(learner.R_noprior), **drift, "seconds": 0.0},
            learner.R_noprior.tolist(),
        )
    out["order"] = [
        learner.stream.class_names[task.classes[0]].split(":")[0] for task in learner.stream.tasks
    ]
    atomic_write_json(part_file(parts, arm, seed), out)
    return out


def verdict(metrics: dict) -> dict:
    last = {a: float(np.mean([m["last"] for m in metrics[a].values()])) for a in metrics}
    gap = last["same"] - last["moelora"]
    gap_noprior = last["same_noprior"] - last["moelora"]
    return {
        "claim": f"last(same) >= last(moelora) + {MARGIN}",
        "last": last,
        "gap": gap,
        "gap_without_prior": gap_noprior,
        "holds": bool(gap >= MARGIN),
        "holds_without_prior": bool(gap_noprior >= MARGIN),
    }


def _matrix_table(matrices: dict, orders: dict, seeds: list[int]) -> str:
    lines = []
    for arm, per_seed in matrices.items():
        R = np.mean([np.array(per_seed[s]) for s in seeds], axis=0)
        T = R.shape[0]
        lines += [
            f"\n{arm}: R[t, j] (%, mean of seeds; task j = j-th task of each seed's order)",
            "",
        ]
        lines += ["| after task | " + " | ".join(f"j={j + 1}" for j in range(T)) + " |"]
        lines += ["|---" * (T + 1) + "|"]
        lines += [
            f"| {t + 1} | " + " | ".join(f"{R[t, j]:.1f}" for j in range(T)) + " |"
            for t in range(T)
        ]
    lines += ["", "task orders: " + "; ".join(f"seed {s}: {', '.join(orders[s])}" for s in seeds)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(TRAINED), choices=TRAINED)
    p.add_argument("--train-per-class", type=int, default=20)
    p.add_argument("--test-per-class", type=int, default=8)
    p.add_argument("--adapted-blocks", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/same.json"))
    p.add_argument("--merge", action="store_true", help="build the result from the finished parts")
    args = p.parse_args()
    base = ContinualConfig(
        stream="domains",
        scenario="domain",
        method="same",
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
        adapted_blocks=args.adapted_blocks,
        max_tokens=args.max_tokens,
        batch_size=16,
    )
    start = time.perf_counter()
    parts = args.out.with_name(args.out.stem + "_parts")
    parts.mkdir(parents=True, exist_ok=True)
    # SAME first (the longest: it also evaluates without the prior), seed by seed
    jobs = [(_job, (a, base, s, parts)) for s in args.seeds for a in args.arms]
    args.seeds, jobs, outs = run_or_merge(
        jobs, parts, args.seeds, merge=args.merge, workers=args.workers, threads=args.threads
    )
    arms = [a for a in ARMS if a in args.arms or (a == "same_noprior" and "same" in args.arms)]
    metrics = {a: {} for a in arms}
    matrices = {a: {} for a in arms}
    orders = {}
    for out, (s, _) in zip(outs, [(s, a) for s in args.seeds for a in args.arms], strict=True):
        orders[s] = out.pop("order")
        for arm, (met, R) in out.items():
            metrics[arm][s] = met
            matrices[arm][s] = R
    wall = time.perf_counter() - start
    config = {
        "recipe": "same",
        "base": dataclasses.asdict(base),
        "arms": {a: {"method": a} for a in arms},
    }
    extra = {"matrices": matrices, "task_orders": orders, "wall_seconds": round(wall, 1)}
    pairs = [(a, b) for a, b in PAIRS if a in arms and b in arms]
    result = make_result("same", "same", config, metrics, pairs=pairs, extra=extra)
    if {"same", "moelora"} <= set(arms):
        result.extra["verdict"] = verdict(metrics)
    write_result(result, args.out)
    table = (
        summary_table([result], list(METRICS), fmt=".2f")
        + "\n"
        + (paired_table([result], list(METRICS), fmt=".2f") if pairs else "")
        + _matrix_table(matrices, orders, args.seeds)
    )
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)
    print("verdict:", result.extra.get("verdict"))
    print(f"wall {wall:.0f} s; result {args.out}")


if __name__ == "__main__":
    main()
