import dataclasses
import itertools

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.routers import ExpertChoiceRouter, TopKRouter, USMoERouter
from moelab.core.routers.usmoe import budget_pairs, solve_budgeted_assignment, unified_scores
from moelab.models import ModelConfig, MoETransformer, with_router
from moelab.serve.generate import generate_ids


def _pairs(plan):
    order = torch.argsort(plan.token_idx * plan.num_experts + plan.expert_idx)
    return plan.token_idx[order], plan.expert_idx[order], plan.weight[order]


def _usmoe(E=4, k=2, **kw):
    return RouterConfig(num_experts=E, top_k=k, kind="usmoe", **kw)


def test_global_budget_is_lp_optimum_brute_force():
    torch.manual_seed(0)
    for T, E, B in [(3, 3, 4), (4, 2, 3), (2, 4, 5)]:
        S = torch.randn(T, E)
        mask = solve_budgeted_assignment(S, B)
        assert int(mask.sum()) == B
        best = max(
            sum(S.view(-1)[list(c)].tolist()) for c in itertools.combinations(range(T * E), B)
        )
        assert float(S[mask].sum()) == pytest.approx(best, abs=1e-6)
        # TC / EC optimum at the same budget can only be lower
        tc = solve_budgeted_assignment(S, B, per_token=-(-B // T))
        assert float(S[tc].sum()) <= best + 1e-6


def test_per_token_cap_brute_force():
    torch.manual_seed(1)
    S = torch.randn(3, 3)
    mask = solve_budgeted_assignment(S, 4, per_token=2)
    best = max(
        sum(S.view(-1)[list(c)].tolist())
        for c in itertools.combinations(range(9), 4)
        if all(sum(1 for i in c if i // 3 == t) <= 2 for t in range(3))
    )
    assert float(S[mask].sum()) == pytest.approx(best, abs=1e-6)
    with pytest.raises(ValueError, match="per_token, per_expert"):
        solve_budgeted_assignment(S, 4, per_token=2, per_expert=2)


def test_token_choice_limit_equals_topk_router():
    torch.manual_seed(2)
    T, D, E, k = 24, 8, 6, 2
    tc = TopKRouter(RouterConfig(num_experts=E, top_k=k), D, init_std=1.0)
    us = USMoERouter(
        _usmoe(E, k, usmoe_rate=0.0, usmoe_constraint="per_token", usmoe_weight_norm="selected"),
        D,
    )
    us.weight.data.copy_(tc.weight.data)
    x = torch.randn(T, D)
    a, b = _pairs(tc(x)), _pairs(us(x, batch_shape=(T,)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=1e-7)


def test_expert_choice_limit_equals_expert_choice_router():
    torch.manual_seed(3)
    T, D, E, k = 16, 8, 4, 2
    ec = ExpertChoiceRouter(RouterConfig(num_experts=E, top_k=k, kind="expert_choice"), D, 1.0)
    us = USMoERouter(
        _usmoe(E, k, usmoe_rate=0.0, usmoe_constraint="per_expert", selection_scope="batch"), D
    )
    us.weight.data.copy_(ec.weight.data)
    x = torch.randn(T, D)
    a, b = _pairs(ec(x)), _pairs(us(x, batch_shape=(2, 8)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)


@pytest.mark.parametrize("fraction", [1.0, 0.86, 0.7, 0.5, 1.3])
def test_budget_met_exactly_per_sequence(fraction):
    torch.manual_seed(4)
    B, S, D, E, k = 3, 10, 8, 4, 2
    r = USMoERouter(_usmoe(E, k, budget_fraction=fraction), D, init_std=1.0)
    plan = r(torch.randn(B * S, D), batch_shape=(B, S))
    assert plan.num_pairs == B * budget_pairs(S, k, fraction)
    counts = torch.bincount(plan.token_idx // S, minlength=B)
    assert counts.tolist() == [round(fraction * k * S + 1e-9) if fraction != 0.86 else 17] * B
    rb = USMoERouter(_usmoe(E, k, budget_fraction=fraction, selection_scope="batch"), D, 1.0)
    assert rb(torch.randn(B * S, D), batch_shape=(B, S)).num_pairs == round(fraction * k * B * S)


def test_unified_score_hand_value():
    logits = torch.tensor([[[0.0, 1.0], [2.0, -1.0]]])  # G=1, S=2, E=2
    w = unified_scores(logits, 0.5, "sigmoid_scaled")
    sm = torch.tensor([[1 / (1 + 2.718281828459045), 1 - 1 / (1 + 2.718281828459045)]])
    sig = torch.sigmoid(torch.tensor(1.0)).item()
    hand00 = 0.5 * (1 / (1 + torch.e)) + 0.5 * (2 / 2) * 0.5
    hand01 = 0.5 * (torch.e / (1 + torch.e)) + 0.5 * sig
    assert w[0, 0, 0].item() == pytest.approx(hand00, abs=1e-6)
    assert w[0, 0, 1].item() == pytest.approx(hand01, abs=1e-6)
    assert sm.sum().item() == pytest.approx(1.0)
    wt = unified_scores(logits, 0.5, "softmax_over_tokens")
    over_tokens_e0 = torch.softmax(torch.tensor([0.0, 2.0]), 0)
    hand = 0.5 * torch.softmax(torch.tensor([2.0, -1.0]), 0)[0] + 0.5 * over_tokens_e0[1]
    assert wt[0, 1, 0].item() == pytest.approx(hand.item(), abs=1e-6)


def test_weight_norm_options_and_gradient():
    torch.manual_seed(5)
    x = torch.randn(12, 8)
    for norm in ("none", "all_experts", "selected"):
        r = USMoERouter(_usmoe(usmoe_weight_norm=norm), 8, init_std=1.0)
        plan = r(x, batch_shape=(1, 12))
        w = unified_scores(plan.logits.view(1, 12, 4), 0.5).view(12, 4)
        want = w[plan.token_idx, plan.expert_idx]
        if norm == "all_experts":
            want = want / w.sum(-1)[plan.token_idx]
        if norm == "selected":
            sums = torch.zeros(12).index_add(0, plan.token_idx, want)
            want = want / sums[plan.token_idx]
        torch.testing.assert_close(plan.weight, want)
        plan.weight.sum().backward()
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_causal_prefix_is_causal_and_last_token_matches_sequence_scope():
    torch.manual_seed(6)
    D, S = 8, 9
    r = USMoERouter(_usmoe(selection_scope="causal_prefix"), D, init_std=1.0)
    full = USMoERouter(_usmoe(), D)
    full.weight.data.copy_(r.weight.data)
    x = torch.randn(S, D)
    p_all = r(x, batch_shape=(1, S))
    p_pre = r(x[:5], batch_shape=(1, 5))
    sel_all = {
        (t, e)
        for t, e in zip(p_all.token_idx.tolist(), p_all.expert_idx.tolist(), strict=False)
        if t < 5
    }
    sel_pre = set(zip(p_pre.token_idx.tolist(), p_pre.expert_idx.tolist(), strict=False))
    assert sel_all == sel_pre  # future tokens never change the past
    p_full = full(x[:5], batch_shape=(1, 5))
    last_full = {
        e
        for t, e in zip(p_full.token_idx.tolist(), p_full.expert_idx.tolist(), strict=False)
        if t == 4
    }
    assert {e for t, e in sel_pre if t == 4} == last_full


def test_layer_passes_batch_shape_and_model_refuses_kv_cache():
    torch.manual_seed(7)
    cfg = ModelConfig.tiny(n_layers=2)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 64, (2, 10))
    us = with_router(model, _usmoe(budget_fraction=0.7))
    assert model.blocks[0].ffn.config.router.kind == "token_choice"  # original untouched
    torch.testing.assert_close(us.blocks[0].ffn.router.weight, model.blocks[0].ffn.router.weight)
    out = us(ids)
    assert [p.num_pairs for p in out.plans] == [2 * budget_pairs(10, 2, 0.7)] * 2
    with pytest.raises(ValueError, match="kv_cache: layer 0 routes with USMoE"):
        us(ids, kv_cache=us.new_kv_cache(2), start_pos=0)
    with pytest.raises(ValueError, match="not valid for causal generation"):
        list(generate_ids(us, [1, 2, 3], max_new_tokens=2))
    causal = with_router(model, _usmoe(selection_scope="causal_prefix"))
    assert len(list(generate_ids(causal, [1, 2, 3], max_new_tokens=4, temperature=0))) == 4
    # token choice swapped back in is identical to the original
    same = with_router(model, cfg.moe.router)
    torch.testing.assert_close(same(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_usmoe_layer_trains_and_respects_padding():
    torch.manual_seed(8)
    cfg = MoEConfig(router=_usmoe(), experts=ExpertsConfig(hidden_size=8, ffn_hidden_size=8))
    layer = MoELayer(cfg)
    x = torch.randn(2, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out = layer(x, mask=mask)
    assert not bool(mask.view(-1)[out.plan.token_idx].logical_not().any())
    assert out.plan.num_pairs == budget_pairs(6, 2, 1.0) + budget_pairs(4, 2, 1.0)
    (out.hidden_states.sum() + sum(out.aux_losses.values())).backward()
    assert layer.router.weight.grad.abs().sum() > 0


def test_config_errors():
    with pytest.raises(ValueError, match="budget_fraction: only used by kind='usmoe'"):
        RouterConfig(budget_fraction=0.5)
    with pytest.raises(ValueError, match="budget_fraction: must be in"):
        _usmoe(budget_fraction=0.0)
    with pytest.raises(ValueError, match="selection_scope"):
        _usmoe(selection_scope="future")
    assert dataclasses.replace(_usmoe(), usmoe_rate=1.0).usmoe_rate == 1.0
