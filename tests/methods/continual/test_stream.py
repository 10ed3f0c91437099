"""Streams: the split and order, and the one-line errors of bad input."""

from __future__ import annotations

import pytest

from moelab.data.labelled import LabelledText
from moelab.errors import InvalidValueError
from moelab.methods.continual.backbone import check_adapted_blocks
from moelab.methods.continual.config import ContinualConfig
from moelab.methods.continual.data import largest_classes, synthetic_texts
from moelab.methods.continual.stream import class_incremental_stream, domain_incremental_stream

from ._tiny import tiny_encoder, tiny_learner

KW = dict(num_tasks=3, classes_per_task=2, train_per_class=5, test_per_class=3, seed=0)


def test_class_incremental_split_and_order():
    data = synthetic_texts(8, 10)
    s = class_incremental_stream(data, **KW)
    assert [t.classes for t in s.tasks] == [(0, 1), (2, 3), (4, 5)]
    for t in s.tasks:
        assert len(t.train) == 2 * 5 and len(t.test) == 2 * 3
        assert not set(t.train) & set(t.test)
        assert {s.labels[i] for i in t.train} == set(t.classes)
    assert s.candidates(1, 0) == (0, 1, 2, 3)  # class-incremental: every seen class
    assert s.tested(1) == (0, 1)
    # the stream label c names the c-th class to arrive; the text is that class's
    for i in s.tasks[2].test:
        assert s.texts[i] in {
            t for t, y in data if data.label_names[y] == s.class_names[s.labels[i]]
        }
    assert class_incremental_stream(data, **KW) == s  # seeded
    assert class_incremental_stream(data, **{**KW, "seed": 1}).class_names != s.class_names
    task_view = class_incremental_stream(data, **KW, scenario="task")
    assert task_view.candidates(2, 0) == (0, 1)


def test_domain_incremental_uses_the_joint_label_space():
    a = LabelledText.from_names([f"a{i}" for i in range(8)], ["x", "y"] * 4, "A")
    b = LabelledText.from_names([f"b{i}" for i in range(8)], ["u", "v"] * 4, "B")
    s = domain_incremental_stream(
        [a, b], train_per_class=2, test_per_class=2, seed=0, domain_order=[1, 0]
    )
    assert s.class_names == ("u", "v", "x", "y")
    assert s.candidates(0, 1) == (0, 1, 2, 3) and s.tested(0) == (0, 1)
    named = domain_incremental_stream(
        [a, b], train_per_class=2, test_per_class=2, seed=0, domain_order=[1, 0], scenario="task"
    )
    assert named.candidates(0, 1) == (2, 3) and named.tested(0) == (0,)
    assert named.tasks == s.tasks  # the same split, another test protocol
    with pytest.raises(InvalidValueError, match="scenario: must be 'domain' or 'task'"):
        domain_incremental_stream(
            [a], train_per_class=2, test_per_class=2, seed=0, scenario="class"
        )


def test_bad_input_one_line_errors():
    data = synthetic_texts(5, 10)
    with pytest.raises(
        InvalidValueError, match=r"5 classes, fewer than num_tasks x classes_per_task = 3 x 2 = 6"
    ):
        class_incremental_stream(data, **KW)
    empty = LabelledText(data.texts, data.labels, (*data.label_names, "ghost"), "synthetic")
    with pytest.raises(InvalidValueError, match="class 'ghost': has no examples"):
        class_incremental_stream(empty, **{**KW, "num_tasks": 3}, class_order=[5, 0, 1, 2, 3, 4])
    with pytest.raises(
        InvalidValueError, match=r"class_order: class 'class001' \(1\) appears twice"
    ):
        class_incremental_stream(synthetic_texts(8, 10), **KW, class_order=[0, 1, 2, 3, 1, 4])
    with pytest.raises(
        InvalidValueError,
        match=r"adapted_blocks: must be in \[1, 3\] \(the encoder has 3 blocks\), got 4",
    ):
        check_adapted_blocks(tiny_encoder(), 4)
    with pytest.raises(InvalidValueError, match="adapted_blocks"):
        tiny_learner("care", adapted_blocks=4)
    with pytest.raises(InvalidValueError, match="num_tasks: 60 tasks x 2 classes need 120 classes"):
        ContinualConfig(num_tasks=60)
    with pytest.raises(InvalidValueError) as e:
        ContinualConfig(epochs=1)
    assert str(e.value) == "epochs: must be >= 2 (two halves), got 1"


def test_largest_classes_breaks_ties_by_name():
    data = LabelledText.from_names(list("abcdefg"), ["p", "q", "q", "r", "r", "s", "s"], "x")
    kept = largest_classes(data, 2)
    assert kept.label_names == ("q", "r") and len(kept) == 4
