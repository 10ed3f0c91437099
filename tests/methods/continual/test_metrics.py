"""Continual metrics against hand-computed matrices and the authors' formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moelab.errors import InvalidValueError
from moelab.methods.continual.metrics import (
    accuracy_curve,
    average_accuracy,
    backward_transfer,
    forgetting,
    last_accuracy,
    negative_backward_transfer,
    xtail_metrics,
)

NAN = math.nan
R = np.array([[90.0, NAN, NAN], [70.0, 80.0, NAN], [60.0, 85.0, 70.0]])


def test_pilot_metrics_by_hand():
    curve = accuracy_curve(R, [10, 10, 10])
    # rows: 90; (70 + 80) / 2; (60 + 85 + 70) / 3
    assert curve.tolist() == pytest.approx([90.0, 75.0, 215.0 / 3])
    assert average_accuracy(curve) == pytest.approx((90 + 75 + 215 / 3) / 3)
    assert last_accuracy(curve) == pytest.approx(215 / 3)
    # old tasks 0, 1: max over time 90 and 85 (the last row counts), final 60 and 85
    assert forgetting(R) == pytest.approx(((90 - 60) + (85 - 85)) / 2)
    assert backward_transfer(R) == pytest.approx(((60 - 90) + (85 - 80)) / 2)
    assert negative_backward_transfer(R) == pytest.approx(((60 - 90) + 0) / 2)


def test_curve_weights_by_test_size():
    # task 0 has 30 test texts, task 1 has 10: A_1 = (30·70 + 10·80) / 40
    assert accuracy_curve(R[:2, :2], [30, 10])[1] == pytest.approx(72.5)


def test_forgetting_matches_the_authors_zero_filled_table():
    """``CaRE/trainer.py``: a zero-filled table of the grouped accuracies, transposed, then
    ``mean((max(axis=1) - table[:, task])[:task])``."""
    rng = np.random.default_rng(0)
    T = 6
    M = np.full((T, T), NAN)
    for t in range(T):
        M[t, : t + 1] = rng.uniform(0, 100, t + 1)
    table = np.zeros([T, T])
    for i in range(T):
        table[i, : i + 1] = M[i, : i + 1]
    table = table.T
    task = T - 1
    authors = np.mean((np.max(table, axis=1) - table[:, task])[:task])
    assert forgetting(M) == pytest.approx(authors)
    curve = accuracy_curve(M, [1] * T)
    assert average_accuracy(curve) == pytest.approx(
        np.mean([M[t, : t + 1].mean() for t in range(T)])
    )


def test_xtail_by_hand():
    full = np.array([[50.0, 10.0, 20.0], [60.0, 70.0, 30.0], [40.0, 65.0, 80.0]])
    out = xtail_metrics(full)
    # transfer: j=1 → R[0,1] = 10; j=2 → (20 + 30) / 2 = 25; mean 17.5
    assert out["transfer"] == pytest.approx(17.5)
    assert out["average"] == pytest.approx(full.mean())
    assert out["last"] == pytest.approx((40 + 65 + 80) / 3)
    with pytest.raises(InvalidValueError, match="X-TAIL"):
        xtail_metrics(R)


def test_one_task_and_bad_matrices():
    assert forgetting([[80.0]]) == 0.0 and backward_transfer([[80.0]]) == 0.0
    with pytest.raises(InvalidValueError, match="square"):
        forgetting(np.zeros((2, 3)))
    with pytest.raises(InvalidValueError, match="diagonal"):
        backward_transfer([[NAN, NAN], [1.0, 2.0]])
