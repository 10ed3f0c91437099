"""Slides of cells for expression prediction: real expression, a paired condition, held-out slides.

MoLF (ICML 2026) predicts a slide's spatial gene expression from histology. No spatial
transcriptomics or histology ships in any package registry, so moelab's offline setting is
(``shared/research/wave3-science.md`` §3.3):

* **Expression (real)**: scanpy's bundled ``pbmc68k_reduced`` (700 PBMCs, 765 genes,
  ``raw.X`` log1p-normalised), read with h5py from the installed scanpy wheel (scanpy is
  never imported; install it ``--no-deps``, like the packaged corpora). The targets are the
  ``n_genes`` highest-variance genes (an HVG-50 analogue; variance over all cells).
* **Tissue (real labels, grouped)**: the 10 ``bulk_labels`` grouped into 4 lineages
  (:data:`PBMC_LINEAGES`), the stand-in for MoLF's oncotree code.
* **Condition (real, paired)**: the "histology" stand-in is a paired real view of the same
  cell, the PCA (``view_size`` components, fitted on training cells) of the genes that are
  not targets; or any ``obsm`` matrix of a user's file (e.g. histology embeddings).
* **Slides (synthetic grouping)**: pseudo-slides of ``slide_size`` cells of one tissue; a
  fraction of each tissue's slides is held out. With real slide ids, slides are chunks of one
  real slide, and whole real slides are held out.
* **Conflict variant (synthetic)**: the view is multiplied by a tissue-specific random
  orthogonal matrix, so one view means different expression in different tissues (MoLF's
  premise that organs map morphology to expression differently).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from moelab.data.corpora import package_dir
from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.data.expression import ExpressionTable, read_h5ad
from moelab.errors import InvalidValueError

SCANPY_INSTALL = "pip install --no-deps scanpy==1.11.5"
PBMC_FILE = "datasets/10x_pbmc68k_reduced.h5ad"

PBMC_LINEAGES: Mapping[str, str] = {
    "CD14+ Monocyte": "myeloid",
    "Dendritic": "myeloid",
    "CD34+": "myeloid",
    "CD19+ B": "B",
    "CD4+/CD25 T Reg": "CD4 T",
    "CD4+/CD45RA+/CD25- Naive T": "CD4 T",
    "CD4+/CD45RO+ Memory": "CD4 T",
    "CD8+ Cytotoxic T": "CD8 T/NK",
    "CD8+/CD45RA+ Naive Cytotoxic": "CD8 T/NK",
    "CD56+ NK": "CD8 T/NK",
}
"""``bulk_labels`` of ``pbmc68k_reduced`` → 4 lineage groups (the "tissues")."""


def load_pbmc68k_reduced() -> ExpressionTable:
    """scanpy's ``pbmc68k_reduced``: ``raw.X`` (700 cells × 765 genes, log1p-normalised) with
    its ``obs`` (``bulk_labels``, ...) and a ``lineage`` column (:data:`PBMC_LINEAGES`).

    Raises:
        CorpusNotInstalledError: scanpy's wheel (the data file) is not installed.
        MissingDependencyError: h5py is not installed.
    """
    path = package_dir("scanpy", "pbmc68k_reduced", SCANPY_INSTALL) / PBMC_FILE
    if not path.is_file():
        raise CorpusNotInstalledError(f"{path} not found; reinstall with: {SCANPY_INSTALL}")
    table = read_h5ad(path, use_raw=True)
    labels = table.column("bulk_labels")
    unknown = sorted(set(labels) - set(PBMC_LINEAGES))
    if unknown:
        raise CorpusError(f"{path}: unknown bulk_labels {unknown[:3]}")
    obs = {**table.obs, "lineage": np.array([PBMC_LINEAGES[x] for x in labels], dtype=object)}
    return ExpressionTable(table.X, table.genes, obs, table.obsm, "scanpy:pbmc68k_reduced")


@dataclass(frozen=True)
class Slides:
    """S slides of P cells each.

    Attributes:
        genes: ``[S, P, G]`` float32 target expression.
        view: ``[S, P, V]`` float32 condition (the paired view).
        tissue: ``[S]`` int64 tissue index of every slide.
        cells: ``[S, P]`` int64 row of every cell in the source table.
    """

    genes: np.ndarray
    view: np.ndarray
    tissue: np.ndarray
    cells: np.ndarray

    @property
    def num_slides(self) -> int:
        return self.genes.shape[0]


@dataclass(frozen=True)
class SlideData:
    """Train and held-out slides with their names.

    Attributes:
        train, test: the slides.
        tissues: tissue names; tissue ``k`` is ``tissues[k]``.
        genes: target gene names (``G``).
        source: the table's source, and the variant.
    """

    train: Slides
    test: Slides
    tissues: tuple[str, ...]
    genes: tuple[str, ...]
    source: str


def top_variance_genes(X: np.ndarray, n: int) -> np.ndarray:
    """Column indices of the ``n`` highest-variance columns of ``X [N, G]``, in decreasing
    variance (ties: lower index first).

    Raises:
        InvalidValueError: ``n`` outside ``[1, G]``.
    """
    G = X.shape[1]
    if not 1 <= n <= G:
        raise InvalidValueError(f"n_genes: must be in [1, {G}] for {G} genes, got {n}")
    var = X.astype(np.float64).var(axis=0)
    return np.argsort(-var, kind="stable")[:n]


def pca_view(X: np.ndarray, train_rows: np.ndarray, size: int) -> np.ndarray:
    """``[N, size]`` float32 PCA scores of ``X [N, d]`` with the mean and principal axes fitted
    on ``train_rows`` only (SVD of the centred training rows; component signs made
    deterministic by a positive largest-magnitude loading), divided by the training scores'
    overall standard deviation so values are O(1).

    Raises:
        InvalidValueError: ``size`` outside ``[1, min(len(train_rows), d)]``.
    """
    fit = X[train_rows].astype(np.float64)
    if not 1 <= size <= min(fit.shape):
        raise InvalidValueError(
            f"view_size: must be in [1, {min(fit.shape)}] for {fit.shape[0]} training cells and "
            f"{fit.shape[1]} view genes, got {size}"
        )
    mean = fit.mean(axis=0)
    _, _, vt = np.linalg.svd(fit - mean, full_matrices=False)
    axes = vt[:size]
    flip = np.sign(axes[np.arange(size), np.abs(axes).argmax(axis=1)])
    axes = axes * flip[:, None]
    scores = (X.astype(np.float64) - mean) @ axes.T
    scale = scores[train_rows].std()
    return (scores / (scale if scale > 0 else 1.0)).astype(np.float32)


def random_rotations(count: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``[count, size, size]`` Haar-random orthogonal matrices (QR of a Gaussian matrix with
    the signs of R's diagonal moved into Q; Mezzadri 2007, arXiv math-ph/0609050)."""
    out = np.empty((count, size, size))
    for k in range(count):
        q, r = np.linalg.qr(rng.standard_normal((size, size)))
        out[k] = q * np.sign(np.diag(r))
    return out


def _chunks(cells: np.ndarray, size: int) -> list[np.ndarray]:
    return [cells[i : i + size] for i in range(0, len(cells) - size + 1, size)]


def _held_out(n: int, fraction: float) -> int:
    """Slides of a group to hold out: ``ceil(fraction · n)``, at least one when n >= 2, and
    never all of them."""
    if n < 2:
        return 0
    return min(max(1, math.ceil(fraction * n)), n - 1)


def _split_slides(
    tissue_idx: np.ndarray,
    slide_ids: np.ndarray | None,
    slide_size: int,
    test_fraction: float,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Cell index arrays of the train and test slides."""
    train, test = [], []
    for k in np.unique(tissue_idx):
        cells = np.flatnonzero(tissue_idx == k)
        if slide_ids is None:
            slides = _chunks(rng.permutation(cells), slide_size)
            n_test = _held_out(len(slides), test_fraction)
            test += slides[:n_test]
            train += slides[n_test:]
            continue
        ids = np.unique(slide_ids[cells])
        ids = ids[rng.permutation(len(ids))]
        n_test = _held_out(len(ids), test_fraction)
        for i, sid in enumerate(ids):
            chunks = _chunks(rng.permutation(cells[slide_ids[cells] == sid]), slide_size)
            (test if i < n_test else train).extend(chunks)
    return train, test


def build_slides(
    table: ExpressionTable,
    *,
    tissue_key: str,
    slide_key: str | None = None,
    view_key: str | None = None,
    n_genes: int = 50,
    view_size: int = 32,
    slide_size: int = 20,
    test_fraction: float = 0.25,
    conflict: bool = False,
    seed: int = 0,
) -> SlideData:
    """Train and held-out slides from ``table`` (the construction of the module docstring).

    Args:
        table: cells × genes.
        tissue_key: ``obs`` column of each cell's tissue (one per slide).
        slide_key: ``obs`` column of real slide ids (None: pseudo-slides per tissue). A real
            slide must hold one tissue; it is cut into chunks of ``slide_size`` cells (the
            remainder is dropped) and held out whole.
        view_key: ``obsm`` matrix to use as the view (None: PCA of the non-target genes).
        n_genes: target genes, the highest-variance ones.
        view_size: PCA components of the view (ignored with ``view_key``).
        slide_size: cells per slide, P.
        test_fraction: share of each tissue's slides (or real slides) held out.
        conflict: rotate each tissue's view by its own random orthogonal matrix.
        seed: the slide split, the pseudo-slides and the rotations.

    Raises:
        InvalidValueError: bad sizes or fractions, a missing column, a real slide with two
            tissues, or no train or no test slide.
    """
    if not (isinstance(slide_size, int) and slide_size >= 2):
        raise InvalidValueError(f"slide_size: must be an int >= 2, got {slide_size!r}")
    if not 0.0 < test_fraction < 1.0:
        raise InvalidValueError(f"test_fraction: must be in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(seed)
    tissue_names = table.column(tissue_key).astype(str)
    tissues = tuple(sorted(set(tissue_names)))
    tissue_idx = np.searchsorted(np.array(tissues), tissue_names)
    slide_ids = None
    if slide_key is not None:
        slide_ids = table.column(slide_key).astype(str)
        for sid in np.unique(slide_ids):
            if len(np.unique(tissue_idx[slide_ids == sid])) > 1:
                raise InvalidValueError(f"{table.source}: slide {sid!r} holds several tissues")
    train, test = _split_slides(tissue_idx, slide_ids, slide_size, test_fraction, rng)
    if not train or not test:
        raise InvalidValueError(
            f"{table.source}: {len(train)} train and {len(test)} test slides of {slide_size} "
            "cells; need both (more cells per tissue, or a smaller slide_size)"
        )
    targets = top_variance_genes(table.X, n_genes)
    train_rows = np.concatenate(train)
    if view_key is None:
        rest = np.setdiff1d(np.arange(table.X.shape[1]), targets)
        if not len(rest):
            raise InvalidValueError(
                f"n_genes: {n_genes} targets leave no gene of {table.source} for the view; "
                "use fewer targets or a view_key"
            )
        view = pca_view(table.X[:, rest], train_rows, view_size)
    else:
        if view_key not in table.obsm:
            raise InvalidValueError(
                f"view_key: {table.source} has no obsm {view_key!r} "
                f"(there are: {', '.join(sorted(table.obsm)) or 'none'})"
            )
        view = table.obsm[view_key].astype(np.float32)
        view = (view - view[train_rows].mean(0)) / max(float(view[train_rows].std()), 1e-12)
    if conflict:
        rotations = random_rotations(len(tissues), view.shape[1], rng)
        view = np.einsum("nv,nvw->nw", view, rotations[tissue_idx]).astype(np.float32)
    genes = table.X[:, targets].astype(np.float32)

    def pack(slides: Sequence[np.ndarray]) -> Slides:
        cells = np.stack(slides)
        return Slides(genes[cells], view[cells], tissue_idx[cells[:, 0]].astype(np.int64), cells)

    variant = "conflict" if conflict else "shared"
    return SlideData(
        pack(train),
        pack(test),
        tissues,
        tuple(table.genes[i] for i in targets),
        f"{table.source}:{variant}",
    )
