"""Expression matrices from AnnData ``.h5ad`` files (read with h5py) and CSV tables.

:class:`ExpressionTable` is what single-cell and spatial recipes start from: a cells × genes
float32 matrix, the gene names, and per-cell annotations (``obs`` columns, ``obsm`` matrices).
:func:`load_expression` reads

* ``.h5ad`` (AnnData's HDF5 layout) with **h5py only** (no ``anndata``/``scanpy`` import):
  ``X`` dense or sparse (CSR/CSC, both the current ``encoding-type`` attributes and the old
  ``h5sparse_format``); ``obs``/``var`` as a group of columns (categoricals as
  ``categories``/``codes`` groups, or code datasets whose ``categories`` attribute references
  the names) or as one compound dataset (old files, categories in ``uns/<column>_categories``);
  ``obsm`` as a group of matrices or a compound dataset. ``use_raw`` reads ``raw/X`` (or the
  old ``raw.X``) and its ``var`` instead.
* ``.csv``: a header row; one row per cell; every column whose values all parse as numbers is a
  gene, except those named in ``obs_columns``; the other columns are ``obs``.

h5py is an optional dependency (``pip install h5py``, the ``science`` extra).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moelab.data.errors import CorpusError
from moelab.errors import InvalidValueError, MissingDependencyError

H5PY_INSTALL = "pip install h5py"


@dataclass(frozen=True)
class ExpressionTable:
    """Cells × genes expression with per-cell annotations.

    Attributes:
        X: ``[N, G]`` float32 expression (whatever the file holds: counts or log1p values).
        genes: the G gene names.
        obs: per-cell columns, each ``[N]`` (strings as ``str`` object arrays, numbers as
            numeric arrays).
        obsm: per-cell matrices, each ``[N, d]`` float.
        source: where it was read from (a path or a package name).

    Raises (construction):
        InvalidValueError: ``X`` is not 2-D, or a gene count, ``obs`` or ``obsm`` length
            disagrees with it.
    """

    X: np.ndarray
    genes: tuple[str, ...]
    obs: Mapping[str, np.ndarray] = field(default_factory=dict)
    obsm: Mapping[str, np.ndarray] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if self.X.ndim != 2:
            raise InvalidValueError(f"{self.source}: X must be 2-D, got shape {self.X.shape}")
        n, g = self.X.shape
        if len(self.genes) != g:
            raise InvalidValueError(f"{self.source}: {g} gene columns but {len(self.genes)} names")
        for kind, cols in (("obs", self.obs), ("obsm", self.obsm)):
            for name, col in cols.items():
                if len(col) != n:
                    raise InvalidValueError(
                        f"{self.source}: {kind} {name!r} has {len(col)} rows, X has {n} cells"
                    )

    @property
    def num_cells(self) -> int:
        return self.X.shape[0]

    def column(self, key: str) -> np.ndarray:
        """The ``obs`` column ``key``.

        Raises:
            InvalidValueError: no such column (names the ones there are).
        """
        if key not in self.obs:
            raise InvalidValueError(
                f"{self.source}: no obs column {key!r} (columns: {', '.join(sorted(self.obs))})"
            )
        return self.obs[key]


def _h5py():
    try:
        import h5py
    except ImportError:
        raise MissingDependencyError(
            f"reading .h5ad files needs h5py; install it with: {H5PY_INSTALL}"
        ) from None
    return h5py


def _decode(values: np.ndarray) -> np.ndarray:
    """Byte strings (fixed-length ``S`` or variable-length) as a ``str`` object array."""
    if values.dtype.kind in "SO":
        return np.array(
            [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values], dtype=object
        )
    return values


def _attr_str(obj: Any, name: str, default: str = "") -> str:
    value = obj.attrs.get(name, default)
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _matrix(node: Any) -> np.ndarray:
    """A dense ``[N, G]`` float32 matrix from a dataset or a sparse group."""
    if not hasattr(node, "keys"):
        return np.asarray(node[()], dtype=np.float32)
    fmt = _attr_str(node, "encoding-type") or _attr_str(node, "h5sparse_format")
    fmt = fmt.removesuffix("_matrix")
    shape = node.attrs.get("shape", node.attrs.get("h5sparse_shape"))
    if fmt not in ("csr", "csc") or shape is None:
        raise CorpusError(f"{node.file.filename}: {node.name} is neither dense nor CSR/CSC sparse")
    n_rows, n_cols = (int(s) for s in shape)
    data = np.asarray(node["data"][()], dtype=np.float32)
    indices = np.asarray(node["indices"][()], dtype=np.int64)
    indptr = np.asarray(node["indptr"][()], dtype=np.int64)
    out = np.zeros((n_rows, n_cols), dtype=np.float32)
    major = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    if fmt == "csr":
        out[major, indices] = data
    else:
        out[indices, major] = data
    return out


def _categories_for(f: Any, column: str) -> np.ndarray | None:
    key = f"uns/{column}_categories"
    return _decode(f[key][()]) if key in f else None


def _codes_to_names(codes: np.ndarray, categories: np.ndarray) -> np.ndarray:
    names = np.empty(len(codes), dtype=object)
    valid = codes >= 0
    names[valid] = categories[codes[valid]]
    names[~valid] = ""  # pandas' missing category (code -1)
    return names


def _frame(f: Any, node: Any) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """``(index, columns)`` of an ``obs``/``var`` dataframe, group or compound layout."""
    if not hasattr(node, "keys"):  # old files: one compound dataset
        table = node[()]
        index, cols = None, {}
        for name in table.dtype.names:
            col = table[name]
            if col.ndim != 1:
                continue
            if name == "index":
                index = _decode(col)
                continue
            cats = _categories_for(f, name)
            cols[name] = _codes_to_names(col, cats) if cats is not None else _decode(col)
        return index, cols
    index_key = _attr_str(node, "_index", "_index")
    index = _decode(node[index_key][()]) if index_key in node else None
    cols = {}
    for name, col in node.items():
        if name in (index_key, "__categories"):
            continue
        if hasattr(col, "keys"):  # anndata >= 0.8 categorical (or nullable) group
            if "codes" in col and "categories" in col:
                cols[name] = _codes_to_names(col["codes"][()], _decode(col["categories"][()]))
            elif "values" in col:
                cols[name] = _decode(col["values"][()])
            continue
        values = col[()]
        if values.ndim != 1:
            continue
        ref = col.attrs.get("categories")
        if ref is not None:  # anndata 0.7: codes with a reference to their categories
            cols[name] = _codes_to_names(values, _decode(f[ref][()]))
        else:
            cols[name] = _decode(values)
    return index, cols


def _obsm(node: Any) -> dict[str, np.ndarray]:
    if hasattr(node, "keys"):
        return {
            k: np.asarray(v[()], dtype=np.float32)
            for k, v in node.items()
            if not hasattr(v, "keys") and v.ndim == 2
        }
    table = node[()]
    return {name: np.asarray(table[name], dtype=np.float32) for name in table.dtype.names}


def read_h5ad(path: str | Path, *, use_raw: bool = False) -> ExpressionTable:
    """Read an AnnData ``.h5ad`` file with h5py (layouts: see the module docstring).

    Args:
        path: the file.
        use_raw: read ``raw.X`` and the raw genes (e.g. all genes, log-normalised, where ``X``
            holds scaled highly variable genes).

    Raises:
        MissingDependencyError: h5py is not installed.
        CorpusError: the file is missing, not HDF5, or lacks ``X``/``var`` (names the file).
    """
    h5py = _h5py()
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CorpusError(f"{path}: not an HDF5 (.h5ad) file ({e})") from None
    with f:
        if use_raw:
            x_key = "raw/X" if "raw/X" in f else "raw.X"
            var_key = "raw/var" if "raw/var" in f else "raw.var"
        else:
            x_key, var_key = "X", "var"
        if x_key not in f or var_key not in f:
            raise CorpusError(f"{path}: no {x_key!r} or {var_key!r} (not an AnnData file?)")
        X = _matrix(f[x_key])
        genes, _ = _frame(f, f[var_key])
        if genes is None:
            genes = np.array([f"gene{i}" for i in range(X.shape[1])], dtype=object)
        obs = _frame(f, f["obs"])[1] if "obs" in f else {}
        obsm = _obsm(f["obsm"]) if "obsm" in f else {}
    return ExpressionTable(X, tuple(genes), obs, obsm, str(path))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_expression_csv(path: str | Path, *, obs_columns: Sequence[str] = ()) -> ExpressionTable:
    """Read a cells × genes CSV table (header row; see the module docstring).

    Args:
        path: the file.
        obs_columns: columns that are annotations even if numeric (e.g. a numeric slide id).

    Raises:
        CorpusError: the file is missing, empty, has ragged rows, or has no numeric column.
        InvalidValueError: a name in ``obs_columns`` is not a column.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: cannot read it as UTF-8 CSV ({e})") from None
    if len(rows) < 2:
        raise CorpusError(f"{path}: needs a header row and at least one cell")
    header, body = rows[0], rows[1:]
    ragged = next((i for i, r in enumerate(body, 2) if len(r) != len(header)), None)
    if ragged is not None:
        raise CorpusError(f"{path}: line {ragged} has another number of fields than the header")
    missing = [c for c in obs_columns if c not in header]
    if missing:
        raise InvalidValueError(f"obs_columns: {path} has no column {missing[0]!r}")
    genes, obs = [], {}
    for j, name in enumerate(header):
        values = [r[j] for r in body]
        if name not in obs_columns and all(_is_number(v) for v in values):
            genes.append((name, np.array(values, dtype=np.float32)))
        else:
            obs[name] = np.array(values, dtype=object)
    if not genes:
        raise CorpusError(f"{path}: no numeric (gene) column")
    X = np.stack([v for _, v in genes], axis=1)
    return ExpressionTable(X, tuple(n for n, _ in genes), obs, {}, str(path))


def load_expression(
    path: str | Path, *, use_raw: bool = False, obs_columns: Sequence[str] = ()
) -> ExpressionTable:
    """Read ``path`` by its suffix: ``.h5ad`` (:func:`read_h5ad`) or ``.csv``
    (:func:`read_expression_csv`).

    Raises:
        InvalidValueError: another suffix.
        MissingDependencyError, CorpusError: see the readers.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".h5ad":
        return read_h5ad(path, use_raw=use_raw)
    if suffix == ".csv":
        return read_expression_csv(path, obs_columns=obs_columns)
    raise InvalidValueError(f"{path}: expected a .h5ad or .csv file, got {suffix or 'no suffix'!r}")
