"""Pruning maths: effective rank, subspace novelty, Spectral-Salience ranks, budgets."""

from __future__ import annotations

import random

import pytest
import torch

from moelab.compress.prune import effective_rank, floors, rank_budget, total_budget, uniform_budget
from moelab.compress.prune.criteria import rank01, subspace_novelty, top_n


def test_effective_rank_identity_is_d_and_rank_one_is_one():
    for d in (1, 3, 17):
        assert effective_rank(torch.eye(d, dtype=torch.float64)) == pytest.approx(d)
    v = torch.randn(9, dtype=torch.float64)
    assert effective_rank(torch.outer(v, v)) == pytest.approx(1.0)
    # two equal eigenvalues and one zero: 2; scaling does not matter
    assert effective_rank(torch.diag(torch.tensor([5.0, 5.0, 0.0]))) == pytest.approx(2.0)
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(16 / 10)
    assert effective_rank(torch.zeros(4, 4)) == 0.0
    with pytest.raises(ValueError, match="cov"):
        effective_rank(torch.zeros(3, 4))


def _basis(*cols, d=12):
    return torch.eye(d, dtype=torch.float64)[:, list(cols)]


def test_subspace_novelty_orthogonal_is_one_duplicate_is_zero():
    bases = {0: _basis(0, 1), 1: _basis(2, 3), 2: _basis(4, 5)}
    assert subspace_novelty(bases, 4, 2).tolist() == [1.0, 1.0, 1.0, 0.0]  # 3 has no basis
    bases[3] = _basis(0, 1).clone()  # a duplicate of expert 0
    esn = subspace_novelty(bases, 4, 2)
    assert esn[0] == pytest.approx(0.0, abs=1e-12) and esn[3] == pytest.approx(0.0, abs=1e-12)
    assert esn[1] == pytest.approx(1.0) and esn[2] == pytest.approx(1.0)
    # half inside the others' span: one of two directions shared -> 1 - 1/2
    half = {0: _basis(0, 1), 1: _basis(1, 2)}
    esn = subspace_novelty(half, 2, 2)
    assert esn.tolist() == pytest.approx([0.5, 0.5])
    # rotated duplicate (same span, other basis) is still a duplicate
    c, s = 0.6, 0.8
    rot = _basis(0, 1) @ torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    esn = subspace_novelty({0: _basis(0, 1), 1: rot, 2: _basis(5, 6)}, 3, 2)
    assert esn[:2].tolist() == pytest.approx([0.0, 0.0], abs=1e-12) and esn[2] == pytest.approx(1)
    assert subspace_novelty({2: _basis(3, 4)}, 3, 2).tolist() == [0.0, 0.0, 1.0]


def test_rank01_and_tie_breaks_follow_numpy_argsort():
    x = torch.tensor([0.3, 0.1, 0.3, 0.9])
    # stable argsort of argsort: ties by index -> ranks [1, 0, 2, 3]
    assert rank01(x).tolist() == pytest.approx([r / (3 + 1e-6) for r in (1, 0, 2, 3)])
    s = torch.tensor([0.5, 0.2, 0.5, 0.5])
    assert top_n(s, 2) == [0, 2]
    assert top_n(s, 2, prefer_high_index=True) == [2, 3]  # argsort(s)[::-1][:2]


def test_total_budget_fraction_absolute_and_bad_values():
    assert total_budget(0.5, [8, 8, 8, 8]) == 16
    assert total_budget(0.75, [8] * 4) == 24 and total_budget(0.25, [16] * 4) == 16
    assert total_budget(0.33, [8] * 4) == 10  # int(10.56)
    assert total_budget(20, [8] * 4) == 20
    for bad in (0.0, 1.0, -0.2, 1.5, 0, 32, 40, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="keep"):
            total_budget(bad, [8] * 4)


def test_rank_budget_hand_computed_example():
    # B = 16, floors 2 -> 8 to share by ranks 1:2:3:4 -> int(.8, 1.6, 2.4, 3.2) = 0,1,2,3;
    # gap 2 -> one each to the two highest-score layers
    assert rank_budget(16, [8] * 4, [2] * 4, [1.0, 2.0, 3.0, 4.0]) == [2, 3, 5, 6]
    # caps: layer 1 is capped at 4 (share 6); the gap of 6 is handed out one expert per
    # non-full layer per cycle, highest score first (ties by order, reversed): 2, 0, 2, 0, 2, 2
    assert rank_budget(14, [4, 4, 8], [2, 2, 2], [1.0, 10.0, 1.0]) == [4, 4, 6]
    # alpha = 0 gives equal scores: shares equal, gap filled from the last layer (stable ties)
    assert rank_budget(10, [8] * 4, [2] * 4, [1.0, 5.0, 2.0, 9.0], alpha=0.0) == [2, 2, 3, 3]
    with pytest.raises(ValueError, match="below"):
        rank_budget(7, [8] * 4, [2] * 4, [1.0] * 4)


def test_budgets_sum_exactly_and_respect_floors_and_caps():
    rng = random.Random(0)
    for _ in range(300):
        L = rng.randint(1, 8)
        E = [rng.randint(2, 16) for _ in range(L)]
        k = [rng.randint(1, e) for e in E]
        low = floors(k, rng.randint(1, 3))
        low = [min(m, e) for m, e in zip(low, E, strict=True)]
        B = rng.randint(sum(low), sum(E))
        ranks = [rng.random() * 50 for _ in range(L)]
        n = rank_budget(B, E, low, ranks, alpha=rng.choice([0.5, 1.0, 2.0]))
        assert sum(n) == B
        assert all(m <= ni <= e for m, ni, e in zip(low, n, E, strict=True))
        try:
            u = uniform_budget(B, E, low)
        except ValueError:
            continue
        assert sum(u) == B and all(m <= ni <= e for m, ni, e in zip(low, u, E, strict=True))
        assert max(u) - min(u) <= 1 or any(ni == e for ni, e in zip(u, E, strict=True))


def test_uniform_budget_refuses_a_share_below_top_k_naming_the_layer():
    assert uniform_budget(16, [8] * 4, [2] * 4) == [4] * 4
    assert uniform_budget(18, [8] * 4, [2] * 4) == [5, 5, 4, 4]
    with pytest.raises(ValueError, match="below"):
        uniform_budget(6, [8] * 4, [2] * 4)
    with pytest.raises(ValueError, match="layer 3"):
        uniform_budget(9, [8, 8, 8, 8], [2, 2, 2, 3])


def test_novelty_span_equals_the_authors_reduced_qr_for_independent_bases():
    g = torch.Generator().manual_seed(0)
    bases = {
        e: torch.linalg.qr(torch.randn(20, 3, generator=g, dtype=torch.float64))[0]
        for e in range(5)
    }
    esn = subspace_novelty(bases, 5, 3)
    for e in range(5):
        q, _ = torch.linalg.qr(torch.cat([bases[j] for j in range(5) if j != e], 1))
        ref = 1 - float((q.T @ bases[e]).pow(2).sum()) / 3
        assert esn[e] == pytest.approx(min(max(ref, 0.0), 1.0), abs=1e-12)
        assert 0.0 < esn[e] < 1.0


def test_qr_span_is_the_authors_rule_and_differs_only_with_dependent_bases():
    g = torch.Generator().manual_seed(1)
    bases = {
        e: torch.linalg.qr(torch.randn(20, 3, generator=g, dtype=torch.float64))[0]
        for e in range(4)
    }
    svd, qr = subspace_novelty(bases, 4, 3), subspace_novelty(bases, 4, 3, span="qr")
    assert torch.allclose(qr, svd, atol=1e-5)  # independent bases: one span (qr in float32)
    # a duplicated expert: the reduced QR of [U_0, U_0, U_2] has 9 columns, 3 of them arbitrary
    # directions orthogonal to the true 6-dimensional span, so expert 3 looks less novel
    dup = {0: bases[0], 1: bases[0].clone(), 2: bases[2], 3: bases[3]}
    svd, qr = subspace_novelty(dup, 4, 3), subspace_novelty(dup, 4, 3, span="qr")
    assert svd[0] == pytest.approx(0.0, abs=1e-12) and svd[1] == pytest.approx(0.0, abs=1e-12)
    assert qr[3] < svd[3] - 0.05
    with pytest.raises(ValueError, match="span: must be svd or qr"):
        subspace_novelty(dup, 4, 3, span="lu")


def test_shuffled_rank_control_moves_every_layers_rank():
    from moelab.compress.prune.budget import rank_budget
    from moelab.compress.prune.pipeline import shuffled

    ranks = [9.0, 3.0, 1.5, 6.0, 2.0]
    out = shuffled(ranks, seed=4)
    assert sorted(out) == sorted(ranks) and all(a != b for a, b in zip(out, ranks, strict=True))
    assert shuffled(ranks, seed=4) == out and shuffled([2.0], seed=4) == [2.0]
    # the same unevenness, other layers: budgets are a permutation of the rank budgets here
    E, low = [8] * 5, [2] * 5
    own, control = rank_budget(20, E, low, ranks), rank_budget(20, E, low, out)
    assert sum(control) == 20 and sorted(control) == sorted(own) and control != own
