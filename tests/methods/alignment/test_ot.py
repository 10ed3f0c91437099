"""MESA stage 1 maths: percentiles, cost, prior, and the semi-relaxed plan against POT."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.alignment.ot import (
    co_selection_prior,
    expert_scores,
    select_top,
    transport_cost,
    transport_plan,
    usage_percentiles,
)


def test_percentiles_are_rank_midpoints():
    f = usage_percentiles(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    assert f.tolist() == [87.5, 12.5, 37.5, 62.5]


def test_cost_is_normalised_formula():
    f = torch.tensor([12.5, 37.5, 62.5, 87.5], dtype=torch.float64)
    raw = [1 / ((x + 1) * (100 - x) ** 2) for x in f.tolist()]
    lo, hi = min(raw), max(raw)
    expected = [(r - lo) / (hi - lo) for r in raw]
    assert transport_cost(f).tolist() == pytest.approx(expected, rel=1e-12)
    assert transport_cost(f)[3] == 1.0  # the tail expert is the expensive one


def test_prior_counts_top1_with_each_selected():
    idx = torch.tensor([[0, 1], [0, 1], [2, 0]])
    p = co_selection_prior(idx, 3, floor=0.0)
    # pairs: (0,0) x2, (0,1) x2, (2,2), (2,0): 6 pairs
    expected = torch.tensor([[2, 2, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.float64) / 6
    assert torch.allclose(p, expected)


def _case(E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(E, generator=g, dtype=torch.float64)
    prior = torch.rand(E, E, generator=g, dtype=torch.float64) + 0.05
    cost = transport_cost(usage_percentiles(torch.rand(E, generator=g)))
    return a / a.sum(), cost, prior / prior.sum()


def test_semi_relaxed_closed_form_by_hand():
    a, cost, prior = _case()
    plan = transport_plan(a, cost, prior, epsilon=0.5)
    k = prior * torch.exp(-cost / 0.5)
    assert torch.allclose(plan[2], a[2] * k[2] / k[2].sum())
    assert torch.allclose(plan.sum(dim=1), a)  # the source marginal is exact


def test_semi_relaxed_matches_pots_unbalanced_as_rho_vanishes():
    pytest.importorskip("ot")
    a, cost, prior = _case()
    closed = transport_plan(a, cost, prior, epsilon=0.05)
    pot = transport_plan(a, cost, prior, epsilon=0.05, rho=1e-6)
    assert (pot - closed).abs().max() < 1e-5
    assert torch.allclose(pot.sum(dim=1), a, atol=1e-10)
    further = transport_plan(a, cost, prior, epsilon=0.05, rho=1.0)
    assert (further - closed).abs().max() > 1e-3  # a real target penalty moves the plan


def test_plan_depends_on_the_cost_and_balanced_is_refused():
    a, cost, prior = _case()
    s_cost = expert_scores(transport_plan(a, cost, prior, epsilon=0.05))
    s_flat = expert_scores(transport_plan(a, torch.zeros_like(cost), prior, epsilon=0.05))
    assert (s_cost - s_flat).abs().max() > 1e-2
    assert s_cost[int(cost.argmax())] < 1e-6  # the most expensive expert receives ~nothing
    with pytest.raises(InvalidValueError, match="ignores the cost"):
        transport_plan(a, cost, prior, rho=math.inf)


def test_select_top_breaks_ties_by_id():
    assert select_top(torch.tensor([0.3, 0.1, 0.3, 0.2]), 2) == [0, 2]
    with pytest.raises(InvalidValueError):
        select_top(torch.tensor([0.3, 0.1]), 3)
