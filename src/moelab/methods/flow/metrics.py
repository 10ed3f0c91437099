"""MoLF's evaluation: per-gene Pearson on held-out slides, routing purity, toy mode precision.

* Per-gene Pearson (the HEST-benchmark metric MoLF reports): for each gene, Pearson's r
  between predicted and true expression across the cells of one slide; a gene constant in
  either is undefined (NaN) and skipped; a slide's score is the mean over its genes.
* Routing purity (a diagnostic; MoLF's project page says its experts are *not* segregated by
  cancer type): each expert's tokens are labelled by their majority tissue, purity is the
  share of tokens carrying their expert's label (cluster purity, Manning et al.,
  *Introduction to Information Retrieval*, §16.3). Chance is the largest tissue's share.
* Toy: the share of samples within ``3σ`` of a mode (mode precision) and the mean distance
  to the nearest mode.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def per_gene_pearson(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    """``[G]`` float64 Pearson r of each gene across the P cells of ``pred, true [P, G]``;
    NaN where either column is constant."""
    p = pred.astype(np.float64) - pred.mean(axis=0, dtype=np.float64)
    t = true.astype(np.float64) - true.mean(axis=0, dtype=np.float64)
    num = (p * t).sum(axis=0)
    den = np.sqrt((p * p).sum(axis=0) * (t * t).sum(axis=0))
    out = np.full(pred.shape[1], np.nan)
    ok = den > 0
    out[ok] = num[ok] / den[ok]
    return out


def slide_pearson(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean per-gene Pearson of one slide over the genes where it is defined (0.0 when it is
    defined for none: no gene varies)."""
    r = per_gene_pearson(pred, true)
    return float(np.nanmean(r)) if np.isfinite(r).any() else 0.0


def routing_purity(experts: np.ndarray, labels: np.ndarray) -> float:
    """Cluster purity of the tokens' experts against their labels: ``Σ_e max_l n(e, l) / N``
    for ``experts, labels [N]`` non-negative ints (1.0: every expert serves one label)."""
    experts = np.asarray(experts, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    table = np.zeros((experts.max() + 1, labels.max() + 1), dtype=np.int64)
    np.add.at(table, (experts, labels), 1)
    return float(table.max(axis=1).sum() / len(experts))


def majority_share(labels: np.ndarray) -> float:
    """The largest label's share of ``labels`` (the purity of routing that ignores the input)."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    return float(counts.max() / counts.sum())


def nearest_mode_distance(points: Tensor, modes: Tensor) -> Tensor:
    """``[n]`` Euclidean distance of each of ``points [n, 2]`` to its nearest of ``modes``."""
    return torch.cdist(points.double(), modes.double()).min(dim=1).values


def mode_precision(points: Tensor, modes: Tensor, radius: float) -> float:
    """Share of ``points`` within ``radius`` of a mode."""
    return float((nearest_mode_distance(points, modes) <= radius).double().mean())
