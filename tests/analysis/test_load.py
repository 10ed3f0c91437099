import math

import pytest
import torch

from moelab.analysis import load_stats, load_stats_from_counts, load_stats_per_layer


def test_balanced_routing_has_zero_cv_and_unit_max_over_mean(make_one_hot):
    rec = make_one_hot([t % 4 for t in range(8)], 4)
    s = load_stats([rec])
    assert s.counts.tolist() == [2, 2, 2, 2]
    assert s.fraction.tolist() == [0.25] * 4
    assert s.cv == 0.0
    assert s.max_over_mean == 1.0
    assert s.dead_experts == []
    assert s.total_pairs == 8


def test_dead_expert_and_hand_computed_cv(make_one_hot):
    s = load_stats([make_one_hot([0, 0, 1, 2], 4)])
    assert s.counts.tolist() == [2, 1, 1, 0]
    assert s.dead_experts == [3]
    # mean 1, population std sqrt((1 + 0 + 0 + 1) / 4)
    assert s.cv == pytest.approx(math.sqrt(0.5))
    assert s.max_over_mean == pytest.approx(2.0)
    assert s.fraction.tolist() == pytest.approx([0.5, 0.25, 0.25, 0.0])


def test_records_of_one_layer_are_summed_and_padding_excluded(make_one_hot, make_record):
    a = make_one_hot([0, 0, 1], 3, mask=[True, True, False])  # padded token's pair dropped
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.3, 0.5]])
    b = make_record(probs, pairs=[(0, 0), (0, 1), (1, 2), (1, 1)], dropped=3)  # top-2
    s = load_stats([a, b])
    assert s.counts.tolist() == [3, 2, 1]
    assert s.total_pairs == 6
    assert s.dropped == 3
    assert s.fraction.tolist() == pytest.approx([0.5, 1 / 3, 1 / 6])
    per_layer = load_stats_per_layer([[a], [b]])
    assert [p.counts.tolist() for p in per_layer] == [[2, 0, 0], [1, 2, 1]]
    assert per_layer[0].dead_experts == [1, 2]


def test_nothing_routed_and_bad_input():
    s = load_stats_from_counts(torch.zeros(3, dtype=torch.long))
    assert (s.cv, s.max_over_mean, s.dead_experts) == (0.0, 0.0, [0, 1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        load_stats_from_counts(torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="1-D"):
        load_stats_from_counts(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="at least one"):
        load_stats([])


def test_records_with_different_expert_counts_are_rejected(make_one_hot):
    with pytest.raises(ValueError, match="E=3"):
        load_stats([make_one_hot([0], 2), make_one_hot([0], 3)])
