"""PNG plots of an :func:`~moelab.analysis.summary.analyze` dict (matplotlib, Agg canvas, no display).

Figures are built on :class:`matplotlib.figure.Figure` with an explicit Agg canvas, so no pyplot
global state or GUI backend is touched. Each ``plot_*`` function writes one PNG atomically into
``out_dir`` under a fixed file name (the report uses the name to pick its explanation) and
returns its path, or None when the analysis holds nothing to plot.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from moelab.utils.atomic import atomic_write_bytes

LOAD_HEATMAP = "load_heatmap.png"
ENTROPY = "entropy.png"
COACTIVATION = "coactivation.png"
TRANSITIONS = "transitions.png"
DOMAIN_PREFERENCE = "domain_preference.png"

DPI = 100
_ANNOTATE_MAX = 8  # annotate heatmap cells with their value up to this many rows/columns


def _save(fig: Figure, out_dir: str | os.PathLike, name: str) -> Path:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return atomic_write_bytes(Path(out_dir) / name, buf.getvalue())


def _heatmap(fig: Figure, ax, m: np.ndarray, vmin=None, vmax=None, fmt="{:.2f}", cmap="viridis"):
    masked = np.ma.masked_invalid(m)
    im = ax.imshow(masked, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    rows, cols = m.shape
    if rows <= _ANNOTATE_MAX and cols <= _ANNOTATE_MAX:
        for r in range(rows):
            for c in range(cols):
                v = m[r, c]
                if np.isfinite(v) and v != 0:  # zeros stay blank to keep the pattern readable
                    red, green, blue, _ = im.cmap(im.norm(v))
                    light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.5
                    color = "black" if light else "white"
                    ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=7, color=color)
    if cols <= 32:
        ax.set_xticks(range(cols))
    if rows <= 32:
        ax.set_yticks(range(rows))
    return im


def _grid(n: int, cell: float = 3.4) -> tuple[Figure, list]:
    ncols = min(4, max(1, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(cell * ncols + 0.6, cell * nrows * 0.9 + 0.6))
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def plot_load_heatmap(analysis: dict, out_dir: str | os.PathLike) -> Path:
    """Layer × expert heatmap of the fraction of routed pairs each expert received."""
    layers = analysis["layers"]
    e_max = max(analysis["num_experts"])
    m = np.full((len(layers), e_max), np.nan)
    for i, lay in enumerate(layers):
        frac = lay["load"]["fraction"]
        m[i, : len(frac)] = frac
    fig = Figure(figsize=(max(4.0, 0.45 * e_max + 2.5), max(2.5, 0.45 * len(layers) + 1.5)))
    ax = fig.add_subplot(1, 1, 1)
    _heatmap(fig, ax, m, vmin=0.0)
    for i, lay in enumerate(layers):
        for e in lay["load"]["dead_experts"]:
            ax.text(e, i, "×", ha="center", va="center", color="red", fontsize=14, weight="bold")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("Share of routed pairs per expert (× = dead expert)")
    return _save(fig, out_dir, LOAD_HEATMAP)


def plot_entropy(analysis: dict, out_dir: str | os.PathLike) -> Path:
    """Routing entropy per layer (nats, with ln E), and normalised entropy and top-1 margin."""
    layers = analysis["layers"]
    x = np.arange(len(layers))
    ent = [lay["confidence"]["entropy"] for lay in layers]
    norm = [lay["confidence"]["normalized_entropy"] for lay in layers]
    margin = [lay["confidence"]["margin"] for lay in layers]
    ln_e = [math.log(e) if e > 0 else 0.0 for e in analysis["num_experts"]]
    fig = Figure(figsize=(10, 3.6))
    ax1 = fig.add_subplot(1, 2, 1)
    ax1.bar(x, ent, color="tab:blue", label="mean entropy")
    ax1.plot(x, ln_e, "k--", marker="_", label="ln E (uniform router)")
    ax1.set_xlabel("layer")
    ax1.set_ylabel("nats")
    ax1.set_xticks(x)
    ax1.set_title("Routing entropy")
    ax1.set_ylim(0, 1.3 * max([*ln_e, *ent, 1e-3]))
    ax1.legend(fontsize=8, loc="upper center", ncols=2)
    ax2 = fig.add_subplot(1, 2, 2)
    ax2.plot(x, norm, marker="o", label="normalised entropy (H / ln E)")
    ax2.plot(x, margin, marker="s", label="top-1 margin (p1 − p2)")
    ax2.set_ylim(-0.02, 1.25)
    ax2.set_xlabel("layer")
    ax2.set_xticks(x)
    ax2.set_title("Router confidence")
    ax2.legend(fontsize=8, loc="upper center", ncols=2)
    fig.tight_layout()
    return _save(fig, out_dir, ENTROPY)


def plot_coactivation(analysis: dict, out_dir: str | os.PathLike) -> Path | None:
    """One P(j | i) co-activation heatmap per layer, in a grid."""
    layers = analysis["layers"]
    fig, axes = _grid(len(layers))
    for ax, lay in zip(axes, layers, strict=True):
        m = np.asarray(lay["coactivation"]["conditional"], dtype=float)
        _heatmap(fig, ax, m, vmin=0.0, vmax=1.0, cmap="magma")
        ax.set_title(f"layer {lay['layer']}: P(j | i)", fontsize=9)
        ax.set_xlabel("expert j")
        ax.set_ylabel("expert i")
    fig.tight_layout()
    return _save(fig, out_dir, COACTIVATION)


def plot_transitions(analysis: dict, out_dir: str | os.PathLike) -> Path | None:
    """Row-normalised top-1 transition heatmaps between adjacent layers (None for one layer)."""
    trans = analysis["transitions"]
    if not trans:
        return None
    fig, axes = _grid(len(trans))
    for ax, t in zip(axes, trans, strict=True):
        m = np.asarray(t["probs"], dtype=float)
        _heatmap(fig, ax, m, vmin=0.0, vmax=1.0, cmap="Blues")
        ax.set_title(f"layer {t['src']} → {t['dst']} (NMI {t['nmi']:.2f})", fontsize=9)
        ax.set_xlabel(f"top-1 expert at layer {t['dst']}")
        ax.set_ylabel(f"top-1 expert at layer {t['src']}")
    fig.tight_layout()
    return _save(fig, out_dir, TRANSITIONS)


def plot_domain_preference(analysis: dict, out_dir: str | os.PathLike) -> Path | None:
    """Domain × expert routing-fraction heatmaps per layer (None without domain labels)."""
    layers = analysis["layers"]
    if not layers or "domains" not in layers[0]:
        return None
    names = analysis.get("domain_names") or []
    fig, axes = _grid(len(layers), cell=3.8)
    for ax, lay in zip(axes, layers, strict=True):
        m = np.asarray(lay["domains"]["fraction"], dtype=float)
        _heatmap(fig, ax, m, vmin=0.0, cmap="viridis")
        ax.set_title(f"layer {lay['layer']} (NMI {lay['domains']['nmi']:.2f})", fontsize=9)
        ax.set_xlabel("expert")
        if len(names) == m.shape[0] and m.shape[0] <= 32:
            ax.set_yticks(range(m.shape[0]))
            ax.set_yticklabels(names, fontsize=7)
    fig.tight_layout()
    return _save(fig, out_dir, DOMAIN_PREFERENCE)


PLOTTERS: Sequence[Callable[[dict, str | os.PathLike], Path | None]] = (
    plot_load_heatmap,
    plot_entropy,
    plot_coactivation,
    plot_transitions,
    plot_domain_preference,
)


def plot_all(analysis: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write every plot that applies to ``analysis`` into ``out_dir``; return the paths written.

    The folder is created if missing. Transitions need at least two layers and the domain plot
    needs ``analyze(..., domains=...)``; those plots are skipped otherwise.
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = [p(analysis, out_dir) for p in PLOTTERS]
    return [p for p in paths if p is not None]
