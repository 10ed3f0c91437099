"""MoRAM (ICML 2026) vs MoE-LoRA with a learned router vs sequential LoRA vs zero-shot on
"text-X-TAIL": five real text domains, frozen MiniLM-L6 as the CLIP analogue, 3 seeds.

Setting (``shared/research/wave3-continual.md`` §2.2; :mod:`moelab.methods.continual.moram`):
the five domains of :mod:`moelab.methods.continual.domains` (WordNet noun and verb
supersenses, fortunes categories, KJV genres, stdlib modules; 78 classes with disjoint label
prompts), 16 training / 20 test texts per class, a seeded domain order per seed. The
classifier is ``100·cos`` between the mean-pooled input and label-prompt embeddings of one
encoder; adapters on q, k, v, attention-output, FFN-in and FFN-out of the top 3 blocks (the
lower 3 cached). Every arm trains 80 AdamW steps per domain at batch 16 (lr 5e-4, cosine),
with the authors' loss (CE over the current domain's classes, seen classes masked, plus the
label→text term). After every domain every domain's test set is scored in the joint 78-class
space.

Metrics: X-TAIL Transfer, Average and Last (``XTAIL/main.py``), and MoRAM's atom usage (mean
atoms passing δ per token and layer, old vs new atoms, seen vs unseen domains, and the share
of (token, layer) pairs with none, where the pretrained output is returned). The claim
checked: MoRAM's Average ≥ MoE-LoRA+router's Average + 2 points, mean of the seeds.

Usage::

    python benchmarks/moram.py                     # 3 seeds, one table
    python benchmarks/moram.py --seeds 0 --iterations 20 --out runs/bench/moram_quick.json
    python benchmarks/moram.py --merge             # the table from the finished parts only

Jobs (one per seed and arm group: MoRAM; MoE-LoRA; sequential LoRA with zero-shot) run over
``--workers`` processes; each finished job is kept in ``<out>_parts/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _pool import part_file, run_or_merge
from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.moram_config import MoRAMSettings
from moelab.methods.continual.report import plot_curves, stream_extra
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_json, atomic_write_text
from moelab.utils.result_tables import paired_table, summary_table
from moelab.utils.results import make_result, write_result

ARMS = ("moram", "prompt-moe-lora", "prompt-seq-lora", "zeroshot")
GROUPS = (("moram",), ("prompt-moe-lora",), ("prompt-seq-lora", "zeroshot"))
MARGIN = 2.0
TABLE = ("transfer", "xtail_average", "xtail_last", "bwt")
"""The table's metrics (X-TAIL's three, and BWT; every metric is in the result file)."""


def _log(method: str, seed: int, t: int, T: int, acc: float) -> None:
    print(f"{time.strftime('%H:%M:%S')} {method} seed {seed}: domain {t + 1}/{T}", flush=True)


def _job(arms: tuple[str, ...], base: ContinualConfig, seed: int, parts: Path):
    """One seed of one arm group, also written to ``parts`` when it ends."""
    recipe = ContinualRecipe(progress=_log)
    result = run_seeds(recipe, base, [seed], arms={a: {"method": a} for a in arms}, pairs=[])
    extra = {a: stream_extra(recipe.history[(a, seed)]) for a in arms}
    for a in arms:
        extra[a]["R"] = recipe.history[(a, seed)].R.tolist()
        if (a, seed) in recipe.atom_usage:
            extra[a]["atom_usage"] = recipe.atom_usage[(a, seed)]
    secs = {a: next(iter(v.values())) for a, v in result.extra["run_seconds"].items()}
    out = ({a: result.metrics[a][seed] for a in arms}, secs, extra)
    atomic_write_json(part_file(parts, arms, seed), out)
    return out


def verdict(result) -> dict:
    m, seeds = result.metrics, list(result.seeds)
    avg = {a: float(np.mean([m[a][s]["xtail_average"] for s in seeds])) for a in result.arms}
    margin = avg["moram"] - avg["prompt-moe-lora"]
    return {
        "claim": f"xtail_average(moram) >= xtail_average(prompt-moe-lora) + {MARGIN}",
        "moram_average": avg["moram"],
        "moe_lora_average": avg["prompt-moe-lora"],
        "margin": margin,
        "holds": bool(margin >= MARGIN),
    }


def usage_table(extra: dict, seeds: list[int]) -> str:
    """Markdown: MoRAM's atom usage per seed (all adapted layers)."""
    keys = ("seen_old", "seen_new", "seen_none", "unseen_old", "unseen_new", "unseen_none")
    rows = ["| seed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for s in seeds:
        u = extra["moram"][s]["atom_usage"]["all"]
        rows.append(f"| {s} | " + " | ".join(f"{u[k]:.3f}" for k in keys) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--iterations", type=int, default=MoRAMSettings.iterations)
    p.add_argument("--adapted-blocks", type=int, default=3)
    p.add_argument("--train-per-class", type=int, default=16)
    p.add_argument("--test-per-class", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/moram.json"))
    p.add_argument(
        "--merge", action="store_true", help="build the result from the finished parts only"
    )
    args = p.parse_args()
    base = ContinualConfig(
        stream="domains",
        scenario="domain",
        method="moram",
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
        adapted_blocks=args.adapted_blocks,
        moram=MoRAMSettings(iterations=args.iterations),
    )
    start = time.perf_counter()
    parts = args.out.with_name(args.out.stem + "_parts")
    parts.mkdir(parents=True, exist_ok=True)
    groups = [g for g in (tuple(a for a in g if a in args.arms) for g in GROUPS) if g]
    jobs = [(_job, (g, base, s, parts)) for s in args.seeds for g in groups]
    args.seeds, jobs, outs = run_or_merge(
        jobs, parts, args.seeds, merge=args.merge, workers=args.workers, threads=args.threads
    )
    arms = [a for a in ARMS if a in args.arms]
    metrics, seconds, extra = ({a: {} for a in arms} for _ in range(3))
    for (_, (_, _, seed, _)), (met, sec, ext) in zip(jobs, outs, strict=True):
        for arm in met:
            metrics[arm][seed], seconds[arm][seed], extra[arm][seed] = met[arm], sec[arm], ext[arm]
    metrics = {a: {s: metrics[a][s] for s in args.seeds} for a in arms}
    wall = time.perf_counter() - start
    config = {
        "recipe": "moram",
        "base": dataclasses.asdict(base),
        "arms": {a: {"method": a} for a in arms},
    }
    result = make_result(
        "moram",
        "moram",
        config,
        metrics,
        extra={"run_seconds": seconds, "streams": extra, "wall_seconds": round(wall, 1)},
    )
    if {"moram", "prompt-moe-lora"} <= set(arms):
        result.extra["verdict"] = verdict(result)
    write_result(result, args.out)
    png = args.out.with_suffix(".png")
    plot_curves(
        {a: {s: extra[a][s]["curve"] for s in args.seeds} for a in arms},
        png,
        f"text-X-TAIL, 5 domains, MiniLM top-{args.adapted_blocks} adapted",
    )
    table = summary_table([result], TABLE) + "\n"
    table += paired_table([result], TABLE) if len(arms) > 1 else ""
    if "moram" in arms:
        table += "\n\nMoRAM atom usage (mean per token and layer):\n\n"
        table += usage_table(extra, args.seeds)
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)
    print("verdict:", result.extra.get("verdict"))
    print(f"wall {wall:.0f} s; result {args.out}, plot {png}")


if __name__ == "__main__":
    main()
