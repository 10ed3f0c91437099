"""MoLF (arXiv 2602.02282): does an MoE velocity field beat a dense one? Five arms, 3 seeds.

Setting (``shared/research/wave3-science.md`` §3.3-3.4; :mod:`moelab.methods.flow`): real PBMC
expression (scanpy's ``pbmc68k_reduced``; 50 highest-variance target genes), the condition a
paired real view (PCA of the other genes) plus a tissue code (4 lineage groups), pseudo-slides
of 20 cells with a quarter of each tissue's slides held out. Two variants: the **shared** view,
and the **conflict** view (synthetic: rotated by a tissue-specific random orthogonal matrix, so
tissues map the view to expression differently, MoLF's premise). Plus the synthetic 8-Gaussian
toy as the mechanism check.

Arms (per variant): ``moe`` (MoLF: top-2 of 6 residual-MLP experts, logit noise, Switch balance
loss), ``moe_nobal`` (no balance loss), ``dense`` (one residual-MLP block with matched active
parameters), ``attention`` (the authors' attention-across-cells head), ``simplemlp`` (the
authors' regression baseline). Toy: ``moe`` and ``dense``.

Metrics: per-gene Pearson on the held-out slides (overall, per tissue, per slide: paired
per-slide differences), routing purity by tissue (diagnostic), toy mode precision and distance
at 2 and 8 Euler steps. Claims checked here:

1. conflict variant, mean of the seeds: Pearson(moe) >= Pearson(dense);
2. toy: precision at 2 steps, moe >= dense + 0.05.

Usage::

    python benchmarks/molf.py                       # 3 seeds, full length (21 min, 2 shared cores)
    python benchmarks/molf.py --quick --seeds 0     # a quick look (a few minutes)

Jobs (one per seed and part: expression, toy) run over ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _finish import finish, mean_sd
from _pool import merge_seed_runs, run_jobs
from moelab.methods.flow import FlowConfig, MoLFRecipe
from moelab.methods.runner import run_seeds
from moelab.utils.results import t_interval

VARIANTS = ("conflict", "shared")
FLOW_ARMS = {
    "moe": {"velocity": "moe"},
    "moe_nobal": {"velocity": "moe", "aux_loss_coeff": 0.0},
    "dense": {"velocity": "dense"},
    "attention": {"velocity": "attention"},
    "simplemlp": {"velocity": "simplemlp"},
}
ARMS = {
    **{f"{v}/{a}": {"variant": v, **o} for v in VARIANTS for a, o in FLOW_ARMS.items()},
    "toy/moe": {"task": "toy", "velocity": "moe"},
    "toy/dense": {"task": "toy", "velocity": "dense"},
}
PAIRS = [
    *((f"{v}/moe", f"{v}/{b}") for v in VARIANTS for b in FLOW_ARMS if b != "moe"),
    ("toy/moe", "toy/dense"),
]
TOY_MARGIN = 0.05


def _part(part: str, base: FlowConfig, seed: int) -> tuple[dict, dict]:
    """Run the arms of one part (``"expression"`` or ``"toy"``) for one seed."""
    arms = {a: o for a, o in ARMS.items() if a.startswith("toy/") == (part == "toy")}
    result = run_seeds(MoLFRecipe(), base, [seed], arms=arms, pairs=[])
    return result.metrics, result.extra["run_seconds"]


def _slide_pairs(metrics: dict, arm: str, base: str, seeds: list[int]) -> list[float]:
    """Per-slide Pearson differences arm − base over every seed's held-out slides."""
    out = []
    for s in seeds:
        names = [m for m in metrics[arm][s] if m.startswith("pearson/slide/")]
        out += [metrics[arm][s][m] - metrics[base][s][m] for m in names]
    return out


def report(result) -> tuple[str, dict]:
    """The markdown table and the claim verdicts of a merged result."""
    seeds = list(result.seeds)
    m = result.metrics

    def col(arm: str, name: str) -> str:
        vals = [m[arm][s][name] for s in seeds if name in m[arm][s]]
        return mean_sd(vals) if vals else ""

    tissues = sorted(
        {k.split("/")[2] for k in m["shared/moe"][seeds[0]] if k.startswith("pearson/tissue/")}
    )
    lines = [
        "| variant | arm | Pearson | " + " | ".join(tissues) + " | w=1 | w=3 | purity (chance) |",
        "|" + "---|" * (6 + len(tissues)),
    ]
    for arm in result.arms:
        if arm.startswith("toy/"):
            continue
        variant, name = arm.split("/")
        purity = col(arm, "routing_purity")
        if purity:
            purity += f" ({col(arm, 'routing_purity_chance')})"
        cells = [col(arm, f"pearson/tissue/{t}") for t in tissues]
        lines.append(
            f"| {variant} | {name} | {col(arm, 'pearson')} | "
            + " | ".join(cells)
            + f" | {col(arm, 'pearson_w1')} | {col(arm, 'pearson_w3')} | {purity} |"
        )
    steps = sorted(
        int(k.split("_")[1]) for k in m["toy/moe"][seeds[0]] if k.startswith("precision")
    )
    lines += [
        "",
        "| toy arm | " + " | ".join(f"precision@{n} | distance@{n}" for n in steps) + " |",
    ]
    lines.append("|" + "---|" * (1 + 2 * len(steps)))
    for arm in ("toy/moe", "toy/dense"):
        cells = [f"{col(arm, f'precision_{n}')} | {col(arm, f'distance_{n}')}" for n in steps]
        lines.append(f"| {arm.split('/')[1]} | " + " | ".join(cells) + " |")

    verdicts = {}
    for variant in VARIANTS:
        moe, dense = f"{variant}/moe", f"{variant}/dense"
        d_seed = [m[moe][s]["pearson"] - m[dense][s]["pearson"] for s in seeds]
        d_slide = _slide_pairs(m, moe, dense, seeds)
        st = t_interval(d_slide)
        verdicts[variant] = {
            "moe_minus_dense_per_seed": d_seed,
            "mean_diff": float(np.mean(d_seed)),
            "slides": len(d_slide),
            "slide_diff_mean": st.mean,
            "slide_diff_ci": list(st.ci) if st.ci else None,
            "slides_moe_ge_dense": float(np.mean([d >= 0 for d in d_slide])),
            "holds": bool(np.mean(d_seed) >= 0),
        }
    toy_d = [m["toy/moe"][s]["precision_2"] - m["toy/dense"][s]["precision_2"] for s in seeds]
    verdicts["toy"] = {
        "precision_2_moe_minus_dense_per_seed": toy_d,
        "mean_diff": float(np.mean(toy_d)),
        "holds": bool(np.mean(toy_d) >= TOY_MARGIN),
    }
    lines += [
        "",
        "| claim | mean diff (per seed) | per-slide diff, 95% CI | slides MoE ≥ dense | holds |",
    ]
    lines.append("|---|---|---|---|---|")
    for variant in VARIANTS:
        v = verdicts[variant]
        ci = v["slide_diff_ci"]
        ci_text = f"{v['slide_diff_mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "—"
        per = ", ".join(f"{d:+.3f}" for d in v["moe_minus_dense_per_seed"])
        lines.append(
            f"| {variant}: Pearson(moe) ≥ Pearson(dense) | {v['mean_diff']:+.3f} ({per}) | "
            f"{ci_text} | {v['slides_moe_ge_dense']:.0%} of {v['slides']} | "
            f"{'yes' if v['holds'] else 'no'} |"
        )
    t = verdicts["toy"]
    per = ", ".join(f"{d:+.3f}" for d in t["precision_2_moe_minus_dense_per_seed"])
    lines.append(
        f"| toy: precision@2(moe) ≥ dense + {TOY_MARGIN} | {t['mean_diff']:+.3f} ({per}) | — | — "
        f"| {'yes' if t['holds'] else 'no'} |"
    )
    return "\n".join(lines) + "\n", verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="200 VAE/flow steps: a correctness look")
    p.add_argument("--vae-steps", type=int, default=None)
    p.add_argument("--flow-steps", type=int, default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/molf.json"))
    args = p.parse_args()
    steps = 200 if args.quick else None
    base = FlowConfig(
        vae_steps=args.vae_steps or steps or FlowConfig.vae_steps,
        flow_steps=args.flow_steps or steps or FlowConfig.flow_steps,
        toy_samples=500 if args.quick else FlowConfig.toy_samples,
    )
    start = time.perf_counter()
    jobs = [(_part, ("expression", base, s)) for s in args.seeds]
    jobs += [(_part, ("toy", base, s)) for s in args.seeds]
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics, seconds = merge_seed_runs(jobs, outs, list(ARMS), args.seeds)
    settings = {
        "recipe": "molf",
        "base": dataclasses.asdict(base),
        "arms": ARMS,
        "quick": args.quick,
        "workers": args.workers,
        "threads": args.threads,
    }
    elapsed = time.perf_counter() - start
    finish(
        "molf",
        settings,
        metrics,
        PAIRS,
        report,
        seconds=seconds,
        elapsed=elapsed,
        out=args.out,
        paired_metrics=["pearson", "precision_2", "precision_8"],
    )


if __name__ == "__main__":
    main()
