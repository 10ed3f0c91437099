"""Results of continual runs: the JSON extras (curves, per-task accuracies) and the
accuracy-over-tasks plot (matplotlib, Agg canvas)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moelab.errors import MissingDependencyError
from moelab.methods.continual.loop import StreamResult
from moelab.utils.atomic import atomic_write_bytes


def stream_extra(result: StreamResult) -> dict[str, list[float]]:
    """``{"curve": A_t, "diag": R[j, j], "last": R[T-1, j], "max": max_t R[t, j]}`` (%, 2
    decimals), enough to recompute every metric of :meth:`StreamResult.metrics`."""
    R = np.nan_to_num(result.R, nan=0.0)

    def r(v) -> list[float]:
        return [round(float(x), 2) for x in v]

    return {
        "curve": r(result.curve),
        "diag": r(np.diag(R)),
        "last": r(R[-1]),
        "max": r(R.max(axis=0)),
    }


def plot_curves(
    curves: Mapping[str, Mapping[Any, list[float]]], path: str | os.PathLike, title: str = ""
) -> Path:
    """Write a PNG of ``A_t`` against the task index: per arm the mean over seeds (line) and
    the range (band). ``curves[arm][seed]`` is one run's curve in %.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependencyError(
            "the accuracy plot needs matplotlib; install it with: pip install matplotlib"
        ) from None
    fig = Figure(figsize=(7.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for arm, per_seed in curves.items():
        m = np.array(list(per_seed.values()), dtype=np.float64)
        x = np.arange(1, m.shape[1] + 1)
        ax.plot(x, m.mean(0), label=f"{arm} (n={m.shape[0]})")
        if m.shape[0] > 1:
            ax.fill_between(x, m.min(0), m.max(0), alpha=0.2)
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("accuracy on all seen classes, A_t (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return atomic_write_bytes(Path(path), buf.getvalue())
