"""Reading expression tables: .h5ad files (current and old AnnData layouts) with h5py, CSV."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.data.errors import CorpusError
from moelab.data.expression import load_expression, read_expression_csv, read_h5ad
from moelab.errors import InvalidValueError

X = np.array([[0.0, 1.5, 0.0], [2.0, 0.0, 3.0], [0.0, 0.0, 4.5], [1.0, 1.0, 0.0]], np.float32)
GENES = ["A", "B", "C"]
TISSUE = ["liver", "lung", "liver", "gut"]


def _csr(h5, name, dense, new_style=True):
    rows, cols = np.nonzero(dense)
    g = h5.create_group(name)
    g.create_dataset("data", data=dense[rows, cols])
    g.create_dataset("indices", data=cols.astype(np.int32))
    g.create_dataset("indptr", data=np.r_[0, np.cumsum(np.bincount(rows, minlength=len(dense)))])
    if new_style:
        g.attrs["encoding-type"] = "csr_matrix"
        g.attrs["shape"] = dense.shape
    else:
        g.attrs["h5sparse_format"] = "csr"
        g.attrs["h5sparse_shape"] = dense.shape


def _write_new(path):
    h5py = pytest.importorskip("h5py")
    strings = h5py.string_dtype()
    with h5py.File(path, "w") as f:
        _csr(f, "X", X)
        obs = f.create_group("obs")
        obs.attrs["_index"] = "_index"
        obs.create_dataset("_index", data=[f"c{i}" for i in range(4)], dtype=strings)
        cat = obs.create_group("tissue")
        cat.attrs["encoding-type"] = "categorical"
        cat.create_dataset("categories", data=["gut", "liver", "lung"], dtype=strings)
        cat.create_dataset("codes", data=np.array([1, 2, 1, 0], np.int8))
        obs.create_dataset("n_counts", data=X.sum(1))
        # anndata 0.7: codes whose "categories" attribute references the names
        names = obs.create_group("__categories").create_dataset(
            "slide", data=["s1", "s2"], dtype=strings
        )
        codes = obs.create_dataset("slide", data=np.array([0, 0, 1, -1], np.int8))
        codes.attrs["categories"] = names.ref
        var = f.create_group("var")
        var.attrs["_index"] = "gene_ids"
        var.create_dataset("gene_ids", data=GENES, dtype=strings)
        f.create_group("obsm").create_dataset("X_emb", data=np.arange(8.0).reshape(4, 2))
        raw = f.create_group("raw")
        raw.create_dataset("X", data=2 * X[:, :2])
        rv = raw.create_group("var")
        rv.attrs["_index"] = "_index"
        rv.create_dataset("_index", data=["A", "B"], dtype=strings)


def _write_old(path):
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        f.create_dataset("X", data=X)
        obs = np.zeros(4, dtype=[("index", "S4"), ("bulk_labels", "i1"), ("n_genes", "<i8")])
        obs["index"] = [b"c0", b"c1", b"c2", b"c3"]
        obs["bulk_labels"] = [1, 2, 1, 0]
        obs["n_genes"] = [1, 2, 1, 2]
        f.create_dataset("obs", data=obs)
        f.create_dataset("uns/bulk_labels_categories", data=np.array([b"gut", b"liver", b"lung"]))
        var = np.zeros(3, dtype=[("index", "S4"), ("means", "<f4")])
        var["index"] = [g.encode() for g in GENES]
        f.create_dataset("var", data=var)
        obsm = np.zeros(4, dtype=[("X_pca", "<f4", (2,))])
        obsm["X_pca"] = np.arange(8.0).reshape(4, 2)
        f.create_dataset("obsm", data=obsm)
        _csr(f, "raw.X", 3 * X, new_style=False)
        f.create_dataset("raw.var", data=var)


def test_current_layout(tmp_path):
    path = tmp_path / "new.h5ad"
    _write_new(path)
    t = read_h5ad(path)
    np.testing.assert_array_equal(t.X, X)
    assert t.genes == tuple(GENES)
    assert list(t.obs["tissue"]) == TISSUE
    np.testing.assert_allclose(t.obs["n_counts"], X.sum(1))
    assert list(t.obs["slide"]) == ["s1", "s1", "s2", ""]  # code −1: missing
    np.testing.assert_array_equal(t.obsm["X_emb"], np.arange(8.0).reshape(4, 2))
    raw = read_h5ad(path, use_raw=True)
    np.testing.assert_array_equal(raw.X, 2 * X[:, :2])
    assert raw.genes == ("A", "B")


def test_old_compound_layout(tmp_path):
    path = tmp_path / "old.h5ad"
    _write_old(path)
    t = load_expression(path)
    np.testing.assert_array_equal(t.X, X)
    assert t.genes == tuple(GENES)
    assert list(t.column("bulk_labels")) == TISSUE
    assert list(t.obs["n_genes"]) == [1, 2, 1, 2]
    np.testing.assert_array_equal(t.obsm["X_pca"], np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(read_h5ad(path, use_raw=True).X, 3 * X)
    with pytest.raises(InvalidValueError, match="no obs column 'tissue'"):
        t.column("tissue")


def test_not_hdf5_or_missing(tmp_path):
    pytest.importorskip("h5py")
    bad = tmp_path / "bad.h5ad"
    bad.write_text("not hdf5")
    with pytest.raises(CorpusError, match="not an HDF5"):
        read_h5ad(bad)
    with pytest.raises(CorpusError, match="no such file"):
        read_h5ad(tmp_path / "none.h5ad")


def test_csv(tmp_path):
    path = tmp_path / "cells.csv"
    lines = ["cell,tissue,slide,A,B,C"]
    for i, row in enumerate(X):
        lines.append(f"c{i},{TISSUE[i]},{i % 2}," + ",".join(str(v) for v in row))
    path.write_text("\n".join(lines) + "\n")
    t = read_expression_csv(path, obs_columns=["slide"])
    np.testing.assert_array_equal(t.X, X)
    assert t.genes == tuple(GENES)
    assert list(t.obs["tissue"]) == TISSUE and list(t.obs["slide"]) == ["0", "1", "0", "1"]
    assert load_expression(path).genes == ("slide", *GENES)  # numeric unless named
    path.write_text("a,b\n1,2\n3\n")
    with pytest.raises(CorpusError, match="line 3"):
        read_expression_csv(path)
    with pytest.raises(InvalidValueError, match=r"\.h5ad or \.csv"):
        load_expression(tmp_path / "x.tsv")
