import torch

from moelab.analysis import coactivation_conditional, coactivation_counts


def test_three_token_hand_example(make_record):
    probs = torch.full((3, 3), 1 / 3)
    pairs = [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (2, 0)]
    C, n = coactivation_counts([make_record(probs, pairs=pairs)])
    assert C.tolist() == [[0, 2, 1], [2, 0, 0], [1, 0, 0]]
    assert n.tolist() == [3, 2, 1]
    P = coactivation_conditional(C, n)
    torch.testing.assert_close(
        P, torch.tensor([[0, 2 / 3, 1 / 3], [1, 0, 0], [1, 0, 0]], dtype=torch.float64)
    )


def test_padding_and_records_sum(make_record):
    probs = torch.full((2, 3), 1 / 3)
    a = make_record(probs, pairs=[(0, 0), (0, 1), (1, 1), (1, 2)], mask=[True, False])
    b = make_record(probs, pairs=[(0, 0), (0, 1)])
    C, n = coactivation_counts([a, b])
    assert C.tolist() == [[0, 2, 0], [2, 0, 0], [0, 0, 0]]
    assert n.tolist() == [2, 2, 0]
    P = coactivation_conditional(C, n)
    assert P[2].tolist() == [0.0, 0.0, 0.0]  # an unused expert gives a zero row, not NaN


def test_top1_routing_has_no_coactivation(make_one_hot):
    C, n = coactivation_counts([make_one_hot([0, 1, 2, 1], 3)])
    assert int(C.sum()) == 0
    assert n.tolist() == [1, 2, 1]
