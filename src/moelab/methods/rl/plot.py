"""Learning curves of a PA-MoE result: greedy success per task against frames, one line per
arm (mean over seeds, a band of ± one sd), one panel per task (matplotlib, Agg canvas)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from moelab.errors import MissingDependencyError
from moelab.utils.atomic import atomic_write_bytes
from moelab.utils.results import BenchmarkResult


def curves(result: BenchmarkResult, arm: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{task: (frames [P], success [S, P])}`` from an arm's ``curve/<task>/<frames>`` metrics."""
    seeds = list(result.seeds)
    first = result.metrics[arm][seeds[0]]
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for task in sorted({k.split("/")[1] for k in first if k.startswith("curve/")}):
        frames = sorted(int(k.split("/")[2]) for k in first if k.startswith(f"curve/{task}/"))
        ys = [[result.metrics[arm][s][f"curve/{task}/{f}"] for f in frames] for s in seeds]
        out[task] = (np.array(frames), np.array(ys))
    return out


def plot_learning_curves(result: BenchmarkResult, path: str | os.PathLike) -> Path:
    """Write the PNG of every arm's curves to ``path`` (atomically) and return it.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependencyError(
            "learning-curve plots need matplotlib; install with: pip install 'moelab[analysis]'"
        ) from None
    per_arm = {arm: curves(result, arm) for arm in result.arms}
    tasks = sorted({t for c in per_arm.values() for t in c})
    fig = Figure(figsize=(4.2 * len(tasks), 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks, strict=True):
        for arm, c in per_arm.items():
            if task not in c:
                continue
            x, ys = c[task]
            m, sd = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(x))
            ax.plot(x / 1000, m, marker="o", ms=3, label=arm)
            ax.fill_between(x / 1000, m - sd, m + sd, alpha=0.15)
        ax.set_title(f"{task}: greedy success")
        ax.set_xlabel("frames (k)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return atomic_write_bytes(Path(path), buf.getvalue())
