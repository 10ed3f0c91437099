import math

import pytest
import torch

from moelab.analysis import confidence_stats, token_margin


def test_uniform_router_has_entropy_ln_e(make_record):
    E = 4
    s = confidence_stats([make_record(torch.full((6, E), 1 / E))])
    assert s.entropy == pytest.approx(math.log(E), rel=1e-6)
    assert s.normalized_entropy == pytest.approx(1.0, rel=1e-6)
    assert s.margin == pytest.approx(0.0, abs=1e-7)


def test_one_hot_router_has_zero_entropy_and_unit_margin(make_one_hot):
    s = confidence_stats([make_one_hot([0, 2, 1, 1], 3)])
    assert s.entropy == 0.0
    assert s.normalized_entropy == 0.0
    assert s.margin == pytest.approx(1.0)


def test_hand_computed_margin_and_entropy_with_padding(make_record):
    probs = [[0.5, 0.3, 0.2], [0.1, 0.3, 0.6], [0.9, 0.05, 0.05]]
    s = confidence_stats([make_record(probs, mask=[True, True, False])])
    assert s.margin == pytest.approx((0.2 + 0.3) / 2, abs=1e-6)
    h = [-sum(p * math.log(p) for p in row) for row in probs[:2]]
    assert s.entropy == pytest.approx(sum(h) / 2, rel=1e-5)
    assert s.normalized_entropy == pytest.approx(sum(h) / 2 / math.log(3), rel=1e-5)
    assert s.num_tokens == 2


def test_tokens_weighted_equally_across_records(make_record, make_one_hot):
    uniform = make_record(torch.full((3, 2), 0.5))  # 3 tokens of entropy ln 2
    confident = make_one_hot([0], 2)  # 1 token of entropy 0
    s = confidence_stats([uniform, confident])
    assert s.entropy == pytest.approx(3 * math.log(2) / 4, rel=1e-6)
    assert s.margin == pytest.approx(0.25, abs=1e-6)


def test_token_margin_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        token_margin(torch.ones(3))
