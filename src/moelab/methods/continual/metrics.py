"""Continual-learning metrics from the accuracy matrix ``R[t, j]``: the accuracy (in %) on task
``j``'s test set after training task ``t``; ``NaN`` where task ``j`` was not tested (a
class-incremental stream tests only ``j <= t``).

Formulas as the authors' code computes them:

* PILOT / CaRE (``CaRE/trainer.py``): the curve ``A_t`` is the accuracy over every test text
  of the seen classes (:func:`accuracy_curve`, weighted by test-set size), ``Ā`` its mean
  (:func:`average_accuracy`), ``A_last`` its last value (:func:`last_accuracy`), and
  forgetting the mean over the old tasks ``j < T-1`` of ``max_t R[t, j] - R[T-1, j]``
  (:func:`forgetting`; ``np.max`` over the whole column, untested entries 0).
* Backward transfer (Lopez-Paz & Ranzato, NeurIPS 2017, arXiv 1706.08840, Eq. 3):
  ``mean_{j<T-1} R[T-1, j] - R[j, j]`` (:func:`backward_transfer`); MoRAM/TRACE's variant
  keeps only the losses, ``mean_{j<T-1} min(R[T-1, j] - R[j, j], 0)``
  (``TRACE/inference/collect_results.py``; :func:`negative_backward_transfer`).
* X-TAIL (``XTAIL/main.py``, lines 189–197) on a full table: Transfer = mean over ``j >= 1``
  of ``mean_{t<j} R[t, j]``, Average = mean of all entries, Last = mean of the last row
  (:func:`xtail_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moelab.errors import InvalidValueError


def _matrix(R) -> np.ndarray:
    m = np.asarray(R, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise InvalidValueError(f"R: expected a non-empty square [T, T] matrix, got {m.shape}")
    if np.isnan(np.diag(m)).any():
        raise InvalidValueError("R: the diagonal R[t, t] must be tested (not NaN)")
    return m


def accuracy_curve(R, test_sizes: Sequence[int]) -> np.ndarray:
    """``A_t`` [T]: the accuracy over the test texts of tasks ``0..t`` after task ``t``, i.e.
    the row mean of ``R[t, :t+1]`` weighted by ``test_sizes`` (texts per task).

    Raises:
        InvalidValueError: ``R`` not square, a NaN on or below the diagonal, sizes of the
            wrong length or not positive.
    """
    m = _matrix(R)
    w = np.asarray(test_sizes, dtype=np.float64)
    if w.shape != (m.shape[0],) or (w <= 0).any():
        raise InvalidValueError(f"test_sizes: expected {m.shape[0]} positive counts, got {w}")
    out = np.empty(m.shape[0])
    for t in range(m.shape[0]):
        row = m[t, : t + 1]
        if np.isnan(row).any():
            raise InvalidValueError(f"R: row {t} has an untested task j <= {t}")
        out[t] = float(row @ w[: t + 1] / w[: t + 1].sum())
    return out


def average_accuracy(curve) -> float:
    """``Ā = mean_t A_t`` (PILOT's "Average Accuracy")."""
    c = np.asarray(curve, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise InvalidValueError(f"curve: expected a non-empty [T] vector, got {c.shape}")
    return float(c.mean())


def last_accuracy(curve) -> float:
    """``A_last = A_{T-1}``."""
    c = np.asarray(curve, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise InvalidValueError(f"curve: expected a non-empty [T] vector, got {c.shape}")
    return float(c[-1])


def forgetting(R) -> float:
    """PILOT's forgetting: ``mean_{j<T-1} (max_t R[t, j] - R[T-1, j])`` (0 for one task).
    Untested entries count as 0, as in ``trainer.py``'s zero-filled table."""
    m = np.nan_to_num(_matrix(R), nan=0.0)
    T = m.shape[0]
    if T == 1:
        return 0.0
    return float(np.mean(m.max(axis=0)[: T - 1] - m[T - 1, : T - 1]))


def backward_transfer(R) -> float:
    """Lopez-Paz BWT: ``mean_{j<T-1} (R[T-1, j] - R[j, j])`` (0 for one task)."""
    m = _matrix(R)
    T = m.shape[0]
    if T == 1:
        return 0.0
    return float(np.mean(m[T - 1, : T - 1] - np.diag(m)[: T - 1]))


def negative_backward_transfer(R) -> float:
    """MoRAM/TRACE BWT: ``mean_{j<T-1} min(R[T-1, j] - R[j, j], 0)`` (0 for one task)."""
    m = _matrix(R)
    T = m.shape[0]
    if T == 1:
        return 0.0
    return float(np.mean(np.minimum(m[T - 1, : T - 1] - np.diag(m)[: T - 1], 0.0)))


def xtail_metrics(R) -> dict[str, float]:
    """X-TAIL's ``{"transfer", "average", "last"}`` of a fully tested table (see the module
    docstring; transfer needs T >= 2).

    Raises:
        InvalidValueError: a NaN anywhere, or T < 2.
    """
    m = _matrix(R)
    if np.isnan(m).any():
        raise InvalidValueError("R: X-TAIL metrics need every task tested after every step")
    T = m.shape[0]
    if T < 2:
        raise InvalidValueError("R: X-TAIL transfer needs at least 2 tasks")
    transfer = np.mean([m[:j, j].mean() for j in range(1, T)])
    return {"transfer": float(transfer), "average": float(m.mean()), "last": float(m[-1].mean())}
