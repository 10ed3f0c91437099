import math

import pytest
import torch

from moelab.analysis import nmi_from_contingency, transition, transitions


def test_hand_transition_matrix(make_one_hot):
    l0 = make_one_hot([0, 0, 1, 2, 1], 3)
    l1 = make_one_hot([1, 1, 0, 0, 2], 3)
    t = transition([l0], [l1])
    assert t.counts.tolist() == [[0, 2, 0], [1, 0, 1], [1, 0, 0]]
    torch.testing.assert_close(
        t.probs, torch.tensor([[0, 1, 0], [0.5, 0, 0.5], [1, 0, 0]], dtype=torch.float64)
    )
    assert t.num_tokens == 5


def test_padding_in_either_layer_is_excluded(make_one_hot):
    l0 = make_one_hot([0, 1, 1], 2, mask=[True, True, False])
    l1 = make_one_hot([1, 0, 0], 2, mask=[True, True, False])
    t = transition([l0], [l1])
    assert t.counts.tolist() == [[0, 1], [1, 0]]


def test_nmi_is_one_for_a_bijection_and_near_zero_when_independent(make_one_hot):
    g = torch.Generator().manual_seed(0)
    E, N = 4, 20000
    a = torch.randint(0, E, (N,), generator=g)
    perm = torch.tensor([2, 0, 3, 1])
    bij = transition([make_one_hot(a, E)], [make_one_hot(perm[a], E)])
    assert bij.nmi == pytest.approx(1.0, abs=1e-9)
    b = torch.randint(0, E, (N,), generator=g)
    ind = transition([make_one_hot(a, E)], [make_one_hot(b, E)])
    assert ind.nmi < 0.005


def test_nmi_matches_an_independent_hand_computation():
    joint = [[3, 1], [0, 2]]
    n = 6
    px = [4 / n, 2 / n]
    py = [3 / n, 3 / n]
    mi = sum(
        (joint[i][j] / n) * math.log((joint[i][j] / n) / (px[i] * py[j]))
        for i in range(2)
        for j in range(2)
        if joint[i][j]
    )
    hx = -sum(p * math.log(p) for p in px)
    hy = -sum(p * math.log(p) for p in py)
    expected = mi / ((hx + hy) / 2)
    assert nmi_from_contingency(torch.tensor(joint)) == pytest.approx(expected, rel=1e-12)
    assert 0.0 < expected < 1.0


def test_transitions_over_layers_and_errors(make_one_hot):
    layers = [[make_one_hot([0, 1], 2)], [make_one_hot([1, 0], 2)], [make_one_hot([1, 1], 2)]]
    ts = transitions(layers)
    assert [(t.src, t.dst) for t in ts] == [(0, 1), (1, 2)]
    assert ts[0].nmi == pytest.approx(1.0)
    assert ts[1].nmi == 0.0  # a constant labeling carries no information about the other
    with pytest.raises(ValueError, match="one to one"):
        transition([make_one_hot([0], 2)], [make_one_hot([0], 2), make_one_hot([1], 2)])
    with pytest.raises(ValueError, match="T=2"):
        transition([make_one_hot([0, 1], 2)], [make_one_hot([0], 2)])
