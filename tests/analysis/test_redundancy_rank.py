import math

import pytest
import torch

from moelab.analysis import effective_rank, expert_redundancy


def test_identical_experts_have_cosine_one():
    y = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    r = expert_redundancy(torch.stack([y, y, 2.0 * y]))
    assert r.mean_pairwise == pytest.approx(1.0, abs=1e-12)


def test_orthogonal_experts_have_cosine_zero():
    g = torch.Generator().manual_seed(0)
    y0 = torch.zeros(6, 4)
    y0[:, :2] = torch.randn(6, 2, generator=g)
    y1 = torch.zeros(6, 4)
    y1[:, 2:] = torch.randn(6, 2, generator=g)
    r = expert_redundancy(torch.stack([y0, y1]))
    assert r.mean_pairwise == pytest.approx(0.0, abs=1e-12)
    # mixed: two identical and one orthogonal -> pairs (1, 0, 0) -> mean 1/3
    r3 = expert_redundancy(torch.stack([y0, y0, y1]))
    assert r3.mean_pairwise == pytest.approx(1 / 3)
    assert r3.similarity[0, 1] == pytest.approx(1.0)
    assert r3.similarity[0, 2] == pytest.approx(0.0, abs=1e-12)


def test_redundancy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="E >= 2"):
        expert_redundancy(torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match=r"\[E, T, D\]"):
        expert_redundancy(torch.ones(3, 2))


def test_effective_rank_identity_rank_one_and_hand_value():
    assert effective_rank(torch.eye(7)) == pytest.approx(7.0, rel=1e-9)
    assert effective_rank(3.0 * torch.eye(4)) == pytest.approx(4.0, rel=1e-9)
    u = torch.randn(10, 1, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 6, generator=torch.Generator().manual_seed(1))
    assert effective_rank(u @ v) == pytest.approx(1.0, abs=1e-6)
    # singular values (3, 1): p = (3/4, 1/4)
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(expected)
    # leading dims are flattened: [B, S, D]
    assert effective_rank(torch.eye(6).reshape(2, 3, 6)) == pytest.approx(6.0)


def test_effective_rank_errors():
    with pytest.raises(ValueError, match="all-zero"):
        effective_rank(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        effective_rank(torch.ones(3))
