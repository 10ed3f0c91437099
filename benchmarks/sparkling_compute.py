"""SPARKLING's compute to equal quality, interpolated on scratch runs of several lengths.

``sparkling.py``'s "FLOPs to target" is where one run's 20-step rolling training loss first
crosses scratch's final value: one noisy crossing. Here, for every (setting, seed) of a
``sparkling.py`` runs folder, the from-scratch run is trained again at ``--fractions`` of its
steps (each a complete run: same data order, warm-up and a cosine ending at its own length;
kept in ``ROOT/scratch-lengths/``; a fraction above 1 brackets runs better than scratch).
With the full-length scratch run they give scratch's final validation bits per byte as a
function of training FLOPs; every run's own final bits per byte is placed on that curve
(piecewise-linear in log FLOPs), and

    saving = 1 − run FLOPs / scratch FLOPs at the same bits per byte,

the paper's "training cost cut" (positive: the run needed less compute than scratch for its
quality). A quality outside the scratch curve's range is extrapolated from the nearest two
points and counted as such (``extrapolated`` = 1). FLOPs: ``sparkling.flops_per_token`` per
step, at the small width before the expansion.

Usage::

    python benchmarks/sparkling.py --settings 0,1,2,3,4 --json sparkling.json   # prints ROOT
    python benchmarks/sparkling_compute.py ROOT --json sparkling_compute.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from pathlib import Path

from _pool import run_jobs
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig
from moelab.train.loop import read_run_info, train
from moelab.utils.results import make_result, write_result
from sparkling import (
    arm_name,
    arm_pairs,
    finished_runs,
    flops_per_token,
    fmt,
    paired_lines,
    read_metrics,
    setting_label,
)


def small_run(folder: Path) -> Path:
    """The shared pre-expansion run of ``folder``'s (setting, seed): ``<key>-small``."""
    return folder.with_name(folder.name.rsplit("-", 1)[0] + "-small")


def run_flops(folder: Path, small: Path | None = None, t_e: int = 0) -> float:
    """Training FLOPs of a finished run: the ``small`` run's width for the ``t_e`` steps
    before its expansion (none for a run without one), its own width's for the others."""
    info = read_run_info(folder)
    tcfg, wide = TrainConfig.from_dict(info["train"]), ModelConfig.from_dict(info["model"])
    tokens = tcfg.batch_size * tcfg.grad_accum * tcfg.seq_len
    f_wide = flops_per_token(wide, tcfg.seq_len)
    if small is None:
        return tokens * tcfg.steps * f_wide
    f_small = flops_per_token(ModelConfig.from_dict(read_run_info(small)["model"]), tcfg.seq_len)
    return tokens * (t_e * f_small + (tcfg.steps - t_e) * f_wide)


def train_scratch(scratch: Path, out: Path, fraction: float) -> tuple[float, float]:
    """One pool job: ``scratch``'s run again at ``fraction`` of its steps, in ``out``;
    (training FLOPs, final validation bits per byte)."""
    info = read_run_info(scratch)
    tcfg = TrainConfig.from_dict(info["train"])
    tcfg = dataclasses.replace(tcfg, steps=round(fraction * tcfg.steps))
    if not (out / "model.safetensors").is_file():
        train(ModelConfig.from_dict(info["model"]), tcfg, out, progress=False)
    return run_flops(out), read_metrics(out)[3]


def equal_quality_flops(curve: list[tuple[float, float]], bpb: float) -> tuple[float, bool]:
    """Scratch FLOPs at ``bpb`` on ``curve`` ((FLOPs, bpb) points, ascending FLOPs):
    piecewise-linear in log FLOPs between the first two neighbouring points whose bpb
    brackets it, else extrapolated from the two points at the nearer end; and whether it was
    extrapolated.

    Raises:
        ValueError: fewer than two points.
    """
    if len(curve) < 2:
        raise ValueError("equal_quality_flops: needs at least two scratch lengths")
    for (f0, b0), (f1, b1) in itertools.pairwise(curve):
        if min(b0, b1) <= bpb <= max(b0, b1) and b0 != b1:
            return _log_interp(f0, b0, f1, b1, bpb), False
    # outside the curve: worse than the shortest run, or better than the longest
    (f0, b0), (f1, b1) = curve[:2] if bpb > curve[0][1] else curve[-2:]
    return _log_interp(f0, b0, f1, b1, bpb), True


def _log_interp(f0: float, b0: float, f1: float, b1: float, bpb: float) -> float:
    t = (bpb - b0) / (b1 - b0)
    return math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the runs folder sparkling.py printed")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--workers", type=int, default=2, help="parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", type=Path, default=None, help="write the shared result JSON here")
    args = ap.parse_args()
    if any(f <= 0 or f == 1 for f in args.fractions):
        ap.error("--fractions: each > 0 and not 1 (the full-length scratch run is already there)")
    t0 = time.time()
    runs = finished_runs(args.root)
    settings = list(dict.fromkeys(setting for setting, _ in runs))
    seeds = sorted(next(iter(runs.values())))
    lengths = args.root / "scratch-lengths"
    grid = [(s, seed, f) for s in settings for seed in seeds for f in sorted(args.fractions)]
    jobs = [
        (
            train_scratch,
            (runs[s, "scratch"][seed], lengths / f"{runs[s, 'scratch'][seed].name}@{f:g}", f),
        )
        for s, seed, f in grid
    ]
    points = dict(zip(grid, run_jobs(jobs, args.workers, args.threads), strict=True))
    metrics: dict[str, dict[int, dict[str, float]]] = {}
    pairs: list[tuple[str, str]] = []
    lengths_text = ", ".join(f"{f:g}" for f in sorted([*args.fractions, 1.0]))
    print(f"\nSPARKLING compute to equal quality: scratch at {lengths_text} × its steps")
    for s in settings:
        label, methods = setting_label(s), [m for (s2, m) in runs if s2 == s]
        savings: dict[str, list[float]] = {}
        for seed in seeds:
            scratch = runs[s, "scratch"][seed]
            full = (run_flops(scratch), read_metrics(scratch)[3])
            small = small_run(scratch)
            t_e = len(read_metrics(small)[0])  # the expansion step: where the small run stopped
            curve = sorted([*(points[s, seed, f] for f in args.fractions), full])
            print(f"{label} seed {seed} scratch curve: "
                  + ", ".join(f"{f / full[0]:.2f}× → {b:.4f}" for f, b in curve))  # fmt: skip
            for m in methods:
                folder = runs[s, m][seed]
                flops = full[0] if m == "scratch" else run_flops(folder, small, t_e)
                bpb = full[1] if m == "scratch" else read_metrics(folder)[3]
                equal, extrapolated = equal_quality_flops(curve, bpb)
                cell = {"saving": 1 - flops / equal, "run_flops_ratio": flops / full[0],
                        "equal_quality_flops_ratio": equal / full[0],
                        "extrapolated": float(extrapolated), "val_bpb": bpb}  # fmt: skip
                metrics.setdefault(arm_name(s, m), {})[seed] = cell
                savings.setdefault(m, []).append(cell["saving"])
        print(f"{label}: saving (1 − run FLOPs / scratch FLOPs at equal val bpb), mean ± sd")
        for m in methods:
            extra = sum(metrics[arm_name(s, m)][seed]["extrapolated"] for seed in seeds)
            print(
                f"  {m:<40} {fmt(savings[m], '+.3f')}  ({extra:.0f} of {len(seeds)} extrapolated)"
            )
        print("\n".join(paired_lines(savings)))
        pairs += arm_pairs(s, methods)
    if args.json is not None:
        config = {"root": str(args.root), "fractions": sorted(args.fractions),
                  "settings": [setting_label(s) for s in settings]}  # fmt: skip
        write_result(
            make_result("sparkling_compute", "sparkling", config, metrics, pairs=pairs), args.json
        )
        print(f"result: {args.json}")
    print(f"total time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
