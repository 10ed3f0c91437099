import pytest

from moelab.analysis import adjacent_consistency, route_stability


def test_adjacent_consistency_hand_example_with_padding(make_one_hot):
    # batch_shape (2, 4): seq 0 = [0, 0, 1, 2], seq 1 = [2, 2, 2, pad(2)].
    # seq 0: (0,0) same, (0,1) diff, (1,2) diff; seq 1: two valid pairs, both same -> 3 / 5.
    # Counting the padded pair or the seq0→seq1 boundary would give 4 / 6.
    rec = make_one_hot(
        [0, 0, 1, 2, 2, 2, 2, 2],
        3,
        mask=[True] * 7 + [False],
        batch_shape=(2, 4),
    )
    a = adjacent_consistency([rec])
    assert (a.matches, a.pairs) == (3, 5)
    assert a.fraction == pytest.approx(0.6)


def test_adjacent_consistency_sums_over_records(make_one_hot):
    r1 = make_one_hot([1, 1, 1], 2, batch_shape=(1, 3))
    r2 = make_one_hot([0, 1, 0], 2, batch_shape=(3,))
    a = adjacent_consistency([r1, r2])
    assert (a.matches, a.pairs) == (2, 4)


def test_batch_shape_must_match_tokens(make_one_hot):
    with pytest.raises(ValueError, match="batch_shape"):
        adjacent_consistency([make_one_hot([0, 1, 0], 2, batch_shape=(2, 2))])


def test_route_stability_between_steps(make_one_hot):
    a = make_one_hot([0, 1, 2, 3, 0], 4)
    b = make_one_hot([0, 1, 3, 3, 1], 4, mask=[True, True, True, True, False])
    s = route_stability(a, b)
    assert (s.matches, s.pairs) == (3, 4)
    assert s.fraction == pytest.approx(0.75)
    assert route_stability(a, a).fraction == 1.0
    with pytest.raises(ValueError, match="same positions"):
        route_stability(a, make_one_hot([0], 4))
