"""Slides for expression prediction: split, targets, the PCA view fitted on training cells, the
conflict rotation; and the real pbmc68k_reduced file when scanpy's wheel is installed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moelab.data.expression import ExpressionTable
from moelab.data.singlecell import (
    PBMC_LINEAGES,
    build_slides,
    pca_view,
    random_rotations,
    top_variance_genes,
)
from moelab.errors import InvalidValueError


def _table(seed=0, per_tissue=(50, 30, 24)) -> ExpressionTable:
    rng = np.random.default_rng(seed)
    n = sum(per_tissue)
    X = rng.gamma(1.0, 1.0, size=(n, 12)).astype(np.float32)
    X[:, 3] *= 10  # the highest-variance genes: 3, then 7
    X[:, 7] *= 5
    tissue = np.repeat(["a", "b", "c"], per_tissue).astype(object)
    slide = np.array([f"{t}{i % 3}" for i, t in enumerate(tissue)], dtype=object)
    return ExpressionTable(X, tuple(f"g{i}" for i in range(12)), {"t": tissue, "s": slide})


def test_pseudo_slides_split_per_tissue():
    table = _table()
    data = build_slides(table, tissue_key="t", n_genes=2, view_size=4, slide_size=5, seed=1)
    assert data.genes == ("g3", "g7") and data.tissues == ("a", "b", "c")
    # slides per tissue: 10, 6, 4 → held out ceil(¼·n): 3, 2, 1
    assert np.bincount(data.test.tissue).tolist() == [3, 2, 1]
    assert np.bincount(data.train.tissue).tolist() == [7, 4, 3]
    tissue = table.obs["t"]
    for slides in (data.train, data.test):
        for s in range(slides.num_slides):  # one tissue per slide
            assert set(tissue[slides.cells[s]]) == {data.tissues[slides.tissue[s]]}
        np.testing.assert_array_equal(slides.genes, table.X[slides.cells][..., [3, 7]])
    assert not set(data.train.cells.ravel()) & set(data.test.cells.ravel())
    assert data.train.view.shape == (14, 5, 4)


def test_view_is_pca_of_the_other_genes_fitted_on_training_cells():
    table = _table()
    data = build_slides(table, tissue_key="t", n_genes=2, view_size=3, slide_size=5, seed=2)
    rest = [i for i in range(12) if i not in (3, 7)]
    train = np.sort(data.train.cells.ravel())
    fit = table.X[train][:, rest].astype(np.float64)
    _, _, vt = np.linalg.svd(fit - fit.mean(0), full_matrices=False)
    scores = (table.X[:, rest] - fit.mean(0)) @ vt[:3].T
    scores /= scores[train].std()
    view = data.test.view.reshape(-1, 3)
    ref = scores[data.test.cells.ravel()]
    # each component matches up to its sign
    for j in range(3):
        sign = np.sign(view[:, j] @ ref[:, j])
        np.testing.assert_allclose(view[:, j], sign * ref[:, j], rtol=1e-4, atol=1e-4)
    assert math.isclose(float(pca_view(table.X, train, 3)[train].std()), 1.0, rel_tol=1e-5)


def test_conflict_rotates_each_tissues_view_by_its_own_orthogonal_matrix():
    table = _table()
    kw = dict(tissue_key="t", n_genes=2, view_size=4, slide_size=5, seed=3)
    shared, conflict = build_slides(table, **kw), build_slides(table, conflict=True, **kw)
    np.testing.assert_array_equal(shared.train.cells, conflict.train.cells)  # same split
    rotations = []
    for k in range(3):
        a = shared.train.view[shared.train.tissue == k].reshape(-1, 4)
        b = conflict.train.view[conflict.train.tissue == k].reshape(-1, 4)
        q = np.linalg.lstsq(a, b, rcond=None)[0]
        np.testing.assert_allclose(q @ q.T, np.eye(4), atol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1), rtol=1e-4)
        rotations.append(q)
    assert np.abs(rotations[0] - rotations[1]).max() > 0.1
    q = random_rotations(2, 5, np.random.default_rng(0))
    np.testing.assert_allclose(q[1].T @ q[1], np.eye(5), atol=1e-12)


def test_real_slides_are_held_out_whole():
    table = _table()
    data = build_slides(
        table, tissue_key="t", slide_key="s", n_genes=2, view_size=3, slide_size=4, seed=0
    )
    slide = table.obs["s"]
    train_ids = set(slide[data.train.cells.ravel()])
    test_ids = set(slide[data.test.cells.ravel()])
    assert not train_ids & test_ids
    assert len(test_ids) == 3  # one of the 3 real slides of each tissue


def test_bad_settings():
    table = _table()
    with pytest.raises(InvalidValueError, match="n_genes"):
        top_variance_genes(table.X, 13)
    with pytest.raises(InvalidValueError, match=r"no gene .* for the view"):
        build_slides(table, tissue_key="t", n_genes=12, slide_size=5)
    with pytest.raises(InvalidValueError, match="slide_size"):
        build_slides(table, tissue_key="t", slide_size=1)
    with pytest.raises(InvalidValueError, match="need both"):
        build_slides(table, tissue_key="t", slide_size=60, view_size=2)
    mixed = ExpressionTable(table.X, table.genes, {"t": table.obs["t"], "s": np.full(104, "x")})
    with pytest.raises(InvalidValueError, match="several tissues"):
        build_slides(mixed, tissue_key="t", slide_key="s")
    with pytest.raises(InvalidValueError, match="obsm"):
        build_slides(table, tissue_key="t", n_genes=2, view_key="X_uni", slide_size=5)


def test_pbmc68k_reduced_from_the_scanpy_wheel():
    pytest.importorskip("h5py")
    from moelab.data.corpora import package_dir
    from moelab.data.errors import CorpusNotInstalledError
    from moelab.data.singlecell import PBMC_FILE, load_pbmc68k_reduced

    try:
        if not (package_dir("scanpy", "pbmc", "") / PBMC_FILE).is_file():
            pytest.skip("scanpy's wheel has no pbmc68k_reduced file")
    except CorpusNotInstalledError:
        pytest.skip("scanpy's wheel is not installed (pip install --no-deps scanpy==1.11.5)")
    table = load_pbmc68k_reduced()
    assert table.X.shape == (700, 765)
    assert table.X.min() >= 0.0 and table.X.max() < 7.0  # log1p-normalised
    assert set(table.column("bulk_labels")) == set(PBMC_LINEAGES)
    lineages, counts = np.unique(table.column("lineage"), return_counts=True)
    assert dict(zip(lineages, counts.tolist(), strict=True)) == {
        "B": 95,
        "CD4 T": 95,
        "CD8 T/NK": 128,
        "myeloid": 382,
    }
    data = build_slides(table, tissue_key="lineage", seed=0)
    # 20-cell slides: 4 + 4 + 6 + 19 = 33; held out 1 + 1 + 2 + 5
    assert (data.train.num_slides, data.test.num_slides) == (24, 9)
    assert len(data.genes) == 50 and data.train.view.shape[-1] == 32
