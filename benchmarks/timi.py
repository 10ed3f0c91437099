"""TiMi (arXiv 2602.21693): does text routed through the MMoE plug-in help forecast announced
events? Six arms, two event variants, 3 seeds, one table.

Setting (``shared/research/wave3-science.md`` §2.3-2.4; :mod:`moelab.methods.forecasting`):
the real half-hourly England & Wales electricity demand (``taylor``, 4,032 steps), windows of
7 days → 1 day every 2 hours, split 70/10/20 in time; 35 % of the windows get a **synthetic**
announced event (surge ×1.12, drop ×0.88, holiday = last week × 0.85) and every window a
templated notice, encoded by the frozen SmolLM2-135M (mean-pooled, z-scored on the training
windows). Variants: **whole**-horizon regime events (the claim's setting) and
**partial**-horizon events (onset and length inside the horizon: the routing-only limit).

Arms (per variant): ``mmoe`` (TiMi: TMoE + SMoE in both blocks), ``unimodal`` (PatchTST-lite),
``concat`` (text as an extra token), ``tmoe``, ``smoe``, ``shuffled`` (MMoE, texts permuted
across windows).

Metrics: test MSE/MAE (target scaled by the train std) on event and event-free windows, MSE
per event type, expert usage by event type and routing purity. The claim (whole-horizon
variant, mean of the seeds): MSE_event(mmoe) ≤ 0.7 × unimodal and ≤ 1.05 × concat, and the
shuffled control does not reach 0.7 × unimodal.

Usage::

    python benchmarks/timi.py                       # 3 seeds, 40 epochs, both variants
    python benchmarks/timi.py --epochs 5 --seeds 0  # a quick look
    python benchmarks/timi.py --render              # tables and plot again from --out

Jobs (one per seed and variant) run over ``--workers`` processes; the notices are encoded once,
first, into ``--text-cache``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from _pool import merge_seed_runs, run_jobs
from moelab.data.forecast_events import EVENT_NAMES, VARIANTS, all_notices
from moelab.methods.forecasting import ARMS, ForecastConfig, TextCache, TiMiRecipe
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_text
from moelab.utils.results import load_result, make_result, t_interval, write_result

ARM_NAMES = {
    "mmoe": "MMoE (TiMi)",
    "unimodal": "unimodal",
    "concat": "concat",
    "tmoe": "TMoE only",
    "smoe": "SMoE only",
    "shuffled": "MMoE, shuffled text",
}
ALL_ARMS = {f"{v}/{a}": {"variant": v, "arm": a} for v in VARIANTS for a in ARMS}
PAIRS = [(f"{v}/mmoe", f"{v}/{a}") for v in VARIANTS for a in ARMS if a != "mmoe"]
RATIO_VS_UNIMODAL, RATIO_VS_CONCAT = 0.7, 1.05


def _part(variant: str, base: ForecastConfig, seed: int) -> tuple[dict, dict]:
    """Every arm of one variant for one seed."""
    arms = {a: o for a, o in ALL_ARMS.items() if o["variant"] == variant}
    cache = TextCache(base.text_encoder, path=base.text_cache)
    result = run_seeds(TiMiRecipe(cache), base, [seed], arms=arms, pairs=[])
    return result.metrics, result.extra["run_seconds"]


def _ms(values: list[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{np.mean(values):{fmt}} ± {np.std(values, ddof=1):{fmt}}"


def _ratio(m: dict, arm: str, base: str, seeds: list[int], metric: str = "mse_event") -> dict:
    """Per-seed ratios ``metric(arm) / metric(base)``, their mean and t-interval, and the
    ratio of the seed means (what the claim compares)."""
    r = [m[arm][s][metric] / m[base][s][metric] for s in seeds]
    st = t_interval(r)
    mean_a = np.mean([m[arm][s][metric] for s in seeds])
    mean_b = np.mean([m[base][s][metric] for s in seeds])
    return {
        "per_seed": r,
        "mean": st.mean,
        "ci": list(st.ci) if st.ci else None,
        "of_means": float(mean_a / mean_b),
    }


def usage_table(m: dict, arm: str, key: str, seed: int) -> tuple[str, np.ndarray]:
    """Markdown of the expert usage ``key`` (``"b1/tmoe"``) of ``arm`` by event type, for one
    seed: expert indices are arbitrary per seed, so a mean over seeds would blur them."""
    E = sum(1 for k in m[arm][seed] if k.startswith(f"usage/{key}/none/"))
    mat = np.array([[m[arm][seed][f"usage/{key}/{t}/e{e}"] for e in range(E)] for t in EVENT_NAMES])
    lines = ["| event | " + " | ".join(f"expert {e}" for e in range(E)) + " |"]
    lines.append("|" + "---|" * (E + 1))
    for t, row in zip(EVENT_NAMES, mat, strict=True):
        lines.append(f"| {t} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    return "\n".join(lines), mat


def report(result) -> tuple[str, dict, dict]:
    """The markdown tables, the claim verdicts and the usage matrices of a result."""
    seeds = list(result.seeds)
    m = result.metrics
    cols = ["mse_event", "mse_free", "mae_event", "mae_free", "mse/surge", "mse/drop"]
    cols += ["mse/holiday", "purity/b1/tmoe"]
    lines = [
        "| variant | arm | MSE event | MSE event-free | MAE event | MAE event-free | "
        "MSE surge | MSE drop | MSE holiday | TMoE purity |",
        "|" + "---|" * 10,
    ]
    for arm in result.arms:
        variant, name = arm.split("/")
        cells = [_ms([m[arm][s][c] for s in seeds]) if c in m[arm][seeds[0]] else "" for c in cols]
        lines.append(f"| {variant} | {ARM_NAMES[name]} | " + " | ".join(cells) + " |")
    chance = _ms([m["whole/mmoe"][s]["purity_chance"] for s in seeds])
    lines.append(f"\nTMoE purity: last block; routing that ignores the input scores {chance}.\n")

    verdicts = {}
    lines += [
        "| variant | ratio of event-window MSE | per seed | mean [95% CI] | of the means |",
        "|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        verdicts[v] = {
            "mmoe_vs_unimodal": _ratio(m, f"{v}/mmoe", f"{v}/unimodal", seeds),
            "mmoe_vs_concat": _ratio(m, f"{v}/mmoe", f"{v}/concat", seeds),
            "shuffled_vs_unimodal": _ratio(m, f"{v}/shuffled", f"{v}/unimodal", seeds),
            "tmoe_vs_unimodal": _ratio(m, f"{v}/tmoe", f"{v}/unimodal", seeds),
            "concat_vs_unimodal": _ratio(m, f"{v}/concat", f"{v}/unimodal", seeds),
        }
        for name, r in verdicts[v].items():
            ci = f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else ""
            per = ", ".join(f"{x:.3f}" for x in r["per_seed"])
            lines.append(
                f"| {v} | {name.replace('_vs_', ' / ')} | {per} | {r['mean']:.3f} {ci} | "
                f"{r['of_means']:.3f} |"
            )
    w = verdicts["whole"]
    claim = {
        "mmoe_le_0.7_unimodal": w["mmoe_vs_unimodal"]["of_means"] <= RATIO_VS_UNIMODAL,
        "mmoe_le_1.05_concat": w["mmoe_vs_concat"]["of_means"] <= RATIO_VS_CONCAT,
        "shuffled_not_0.7": w["shuffled_vs_unimodal"]["of_means"] > RATIO_VS_UNIMODAL,
    }
    claim["holds"] = all(claim.values())
    verdicts["claim"] = claim
    lines.append(
        "\nThe claim (whole-horizon, ratios of the seed means): "
        + ", ".join(f"{k}: {'yes' if ok else 'no'}" for k, ok in claim.items())
    )
    usage = {}
    for v in VARIANTS:
        for key in ("b1/tmoe", "b1/smoe"):
            text, mat = usage_table(m, f"{v}/mmoe", key, seeds[0])
            usage[f"{v}/mmoe/{key}"] = mat.tolist()
            title = f"Expert usage, {v}-horizon MMoE, {key}, seed {seeds[0]} (share of windows):"
            lines += ["", title, "", text]
    return "\n".join(lines) + "\n", verdicts, usage


def plot_usage(usage: dict, path: Path) -> None:
    """Heatmaps of the usage matrices (event type × expert) of the MMoE arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(usage)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        mat = np.array(usage[key])
        ax.imshow(mat, vmin=0, vmax=1, cmap="viridis")
        for (i, j), v in np.ndenumerate(mat):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w")
        ax.set_xticks(range(mat.shape[1]), [f"e{e}" for e in range(mat.shape[1])])
        ax.set_yticks(range(len(EVENT_NAMES)), EVENT_NAMES)
        ax.set_title(
            key.replace("/mmoe/b1/", ", ")
            .replace("whole", "whole-h.")
            .replace("partial", "partial-h."),
            fontsize=9,
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_reports(table: str, usage: dict, out: Path) -> None:
    atomic_write_text(out.with_suffix(".md"), table)
    plot_usage(usage, out.with_suffix(".png"))
    print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=ForecastConfig.epochs)
    p.add_argument("--text-encoder", default="smollm2")
    p.add_argument("--text-cache", type=Path, default=Path("runs/cache/timi-smollm2.safetensors"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/timi.json"))
    p.add_argument(
        "--render", action="store_true", help="only re-render the tables and plot of --out"
    )
    args = p.parse_args()
    if args.render:
        result = load_result(args.out)
        table, verdicts, usage = report(result)
        extra = {**result.extra, "claims": verdicts, "usage": usage}
        write_result(dataclasses.replace(result, extra=extra), args.out)
        _write_reports(table, usage, args.out)
        return
    base = ForecastConfig(
        epochs=args.epochs, text_encoder=args.text_encoder, text_cache=str(args.text_cache)
    )
    start = time.perf_counter()
    args.text_cache.parent.mkdir(parents=True, exist_ok=True)
    TextCache(base.text_encoder, path=args.text_cache).encode(all_notices(base.horizon))
    encoded = time.perf_counter() - start
    jobs = [(_part, (v, base, s)) for s in args.seeds for v in VARIANTS]
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics, seconds = merge_seed_runs(jobs, outs, list(ALL_ARMS), args.seeds)
    settings = {
        "recipe": "timi",
        "base": dataclasses.asdict(base),
        "arms": ALL_ARMS,
        "workers": args.workers,
        "threads": args.threads,
    }
    elapsed = time.perf_counter() - start
    result = make_result("timi", "timi", settings, metrics, pairs=PAIRS)
    table, verdicts, usage = report(result)
    result = dataclasses.replace(
        result,
        extra={
            "run_seconds": seconds,
            "wall_seconds": elapsed,
            "text_encoding_seconds": encoded,
            "claims": verdicts,
            "usage": usage,
        },
    )
    write_result(result, args.out)
    _write_reports(table, usage, args.out)
    print(f"wall time {elapsed / 60:.1f} min ({math.ceil(elapsed)} s); result: {args.out}")


if __name__ == "__main__":
    main()
