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
    r = USMoERouter(_usmoe(E, k, budget_fraction=fraction, selection_scope="sequence"), D, 1.0)
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
    assert w[0, 0, 0].item() == pytest.approx(0.5 * sm[0, 0].item() + 0.25, abs=1e-6)
    # the paper's EC-style score: softmax over the 2 tokens for each expert, no renormalisation
    wp = unified_scores(logits, 0.5, "paper_expert_choice")
    e0 = torch.softmax(torch.tensor([0.0, 2.0]), 0)  # expert 0 over tokens
    e1 = torch.softmax(torch.tensor([1.0, -1.0]), 0)  # expert 1 over tokens
    hand = 0.5 * torch.softmax(torch.tensor([2.0, -1.0]), 0)[0] + 0.5 * e0[1]
    assert wp[0, 1, 0].item() == pytest.approx(hand.item(), abs=1e-6)
    # the code's commented-out form: token 1's row (e0[1], e1[1]) renormalised over experts
    wt = unified_scores(logits, 0.5, "softmax_over_tokens")
    alt = e0[1] / (e0[1] + e1[1])
    hand = 0.5 * torch.softmax(torch.tensor([2.0, -1.0]), 0)[0] + 0.5 * alt
    assert wt[0, 1, 0].item() == pytest.approx(hand.item(), abs=1e-6)
    torch.testing.assert_close(wt.sum(-1), torch.ones(1, 2))  # both terms per-token simplices


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
    x = torch.randn(S, D)
    full = USMoERouter(_usmoe(selection_scope="sequence"), D)
    full.weight.data.copy_(r.weight.data)
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
    us = with_router(model, _usmoe(budget_fraction=0.7, selection_scope="sequence"))
    assert model.blocks[0].ffn.config.router.kind == "token_choice"  # original untouched
    torch.testing.assert_close(us.blocks[0].ffn.router.weight, model.blocks[0].ffn.router.weight)
    out = us(ids)
    assert [p.num_pairs for p in out.plans] == [2 * budget_pairs(10, 2, 0.7)] * 2
    assert us.noncausal_routing_layers() == [0, 1]
    with pytest.raises(ValueError, match="kv_cache: layer 0 routes with USMoE"):
        us(ids, kv_cache=us.new_kv_cache(2), start_pos=0)
    with pytest.raises(ValueError, match="not valid for causal generation"):
        list(generate_ids(us, [1, 2, 3], max_new_tokens=2))
    for scope in ("position", "causal_prefix"):
        causal = with_router(model, _usmoe(selection_scope=scope))
        assert causal.noncausal_routing_layers() == []
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
    # position scope: 4 positions with 2 real tokens (budget 4 each), 2 with 1 (budget 2)
    assert out.plan.num_pairs == 4 * budget_pairs(2, 2, 1.0) + 2 * budget_pairs(1, 2, 1.0)
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


# ---- faithful to the authors' code (github giangdip2410/USMoE @70d6447), transcribed slowly


def _reference_training_free_block(logits_BSE, k, r=0.5):
    """modeling_deepseek/olmoe: per sequence b, w = (1−r)·softmax_E + r·(2/E)·sigmoid; the
    top-(S·k) entries of the flattened (S·E) row are selected, weight w (no renormalisation).
    Returns {(b, s, e): weight}."""
    B, S, E = logits_BSE.shape
    out = {}
    for b in range(B):
        entries = []
        for s in range(S):
            row = logits_BSE[b, s].double()
            sm = torch.softmax(row, 0)
            for e in range(E):
                w = (1 - r) * sm[e].item() + r * (2 / E) * torch.sigmoid(row[e]).item()
                entries.append((w, s * E + e))
        entries.sort(key=lambda t: (-t[0], t[1]))
        for w, flat in entries[: S * k]:
            out[(b, flat // E, flat % E)] = w
    return out


def _reference_training_scratch_block(logits_TBE, k, r=0.5):
    """custom_transformer.FMoETransformerMLP on Transformer-XL's [time, batch, D] tensors: its
    ``batch_size, sequence_length = shape`` reads (time, batch), so each group is one time
    position t across the batch, with the top-(batch·k) entries of its (batch·E) table."""
    T, B, E = logits_TBE.shape
    out = {}
    for t in range(T):
        entries = []
        for b in range(B):
            row = logits_TBE[t, b].double()
            sm = torch.softmax(row, 0)
            for e in range(E):
                w = (1 - r) * sm[e].item() + r * (2 / E) * torch.sigmoid(row[e]).item()
                entries.append((w, b * E + e))
        entries.sort(key=lambda t_: (-t_[0], t_[1]))
        for w, flat in entries[: B * k]:
            out[(flat // E, t, flat % E)] = w  # keyed (batch, time, expert)
    return out


def _plan_dict(plan, S):
    return {
        (t // S, t % S, e): w
        for t, e, w in zip(
            plan.token_idx.tolist(), plan.expert_idx.tolist(), plan.weight.tolist(), strict=True
        )
    }


@pytest.mark.parametrize("scope", ["sequence", "position"])
def test_matches_transcription_of_the_authors_blocks(scope):
    torch.manual_seed(11)
    B, S, D, E, k = 3, 7, 8, 6, 2
    r = USMoERouter(_usmoe(E, k, selection_scope=scope), D, init_std=1.0)
    x = torch.randn(B, S, D)
    plan = r(x.reshape(B * S, D), batch_shape=(B, S))
    logits = plan.logits.view(B, S, E)
    ref = (
        _reference_training_free_block(logits, k)
        if scope == "sequence"
        else _reference_training_scratch_block(logits.transpose(0, 1), k)
    )
    got = _plan_dict(plan, S)
    assert set(got) == set(ref)
    for key, w in ref.items():
        assert got[key] == pytest.approx(w, abs=1e-6)


def test_position_scope_is_causal_in_time():
    torch.manual_seed(12)
    B, S, D = 4, 9, 8
    r = USMoERouter(_usmoe(selection_scope="position"), D, init_std=1.0)
    x = torch.randn(B, S, D)
    full = _plan_dict(r(x.reshape(-1, D), batch_shape=(B, S)), S)
    pre = _plan_dict(r(x[:, :5].reshape(-1, D), batch_shape=(B, 5)), 5)
    assert {key: w for key, w in full.items() if key[1] < 5} == pytest.approx(pre)


@pytest.mark.parametrize("constraint", ["global", "per_token", "per_expert"])
def test_lp_selection_equals_scipy_linprog(constraint):
    linprog = pytest.importorskip("scipy.optimize").linprog
    gen = torch.Generator().manual_seed(13)
    for trial in range(6):
        T, E = 5 + trial % 3, 4
        S = torch.randn(T, E, generator=gen, dtype=torch.float64)
        B = 2 * T - trial % 2
        per_token = 2 if constraint == "per_token" else None
        per_expert = -(-B // E) if constraint == "per_expert" else None
        mask = solve_budgeted_assignment(S, B, per_token, per_expert)
        a_eq, b_eq = [[1.0] * (T * E)], [B]
        a_ub, b_ub = [], []
        if per_token is not None:
            for t in range(T):
                a_ub.append([1.0 if i // E == t else 0.0 for i in range(T * E)])
                b_ub.append(per_token)
        if per_expert is not None:
            for e in range(E):
                a_ub.append([1.0 if i % E == e else 0.0 for i in range(T * E)])
                b_ub.append(per_expert)
        res = linprog(
            -S.reshape(-1).numpy(), A_ub=a_ub or None, b_ub=b_ub or None,
            A_eq=a_eq, b_eq=b_eq, bounds=(0, 1), method="highs",
        )  # fmt: skip
        assert res.status == 0
        assert float(S[mask].sum()) == pytest.approx(-res.fun, abs=1e-8)
        assert int(mask.sum()) == B


@pytest.mark.parametrize("score", ["sigmoid_scaled", "softmax_over_tokens", "paper_expert_choice"])
def test_causal_prefix_incremental_equals_full_recomputation(score):
    torch.manual_seed(14)
    B, S, D, E = 2, 11, 8, 4
    cfg = _usmoe(E, 2, selection_scope="causal_prefix", usmoe_expert_score=score,
                 budget_fraction=0.8)  # fmt: skip
    r = USMoERouter(cfg, D, init_std=1.0)
    x = torch.randn(B, S, D)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :2] = False  # left padding in row 1
    full = _plan_dict(r(x.reshape(-1, D), batch_shape=(B, S), token_mask=valid.reshape(-1)), S)
    state = r.new_prefix_state(B)
    got = {}
    for start, stop in [(0, 4), (4, 5), (5, 6), (6, 11)]:  # a prefill, then steps, then a chunk
        n = stop - start
        plan = r(
            x[:, start:stop].reshape(-1, D), batch_shape=(B, n),
            token_mask=valid[:, start:stop].reshape(-1), prefix_state=state,
        )  # fmt: skip
        got.update({(b, s + start, e): w for (b, s, e), w in _plan_dict(plan, n).items()})
    assert state.length == S
    assert set(got) == set(full)
    for key, w in full.items():
        assert got[key] == pytest.approx(w, abs=1e-6)


def test_causal_prefix_kv_cache_decoding_equals_recomputation():
    torch.manual_seed(15)
    cfg = ModelConfig.tiny(n_layers=2)
    model = with_router(
        MoETransformer(cfg), _usmoe(selection_scope="causal_prefix", budget_fraction=0.75)
    ).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        want = model(ids).logits
        cache = model.new_kv_cache(1)
        parts = [model(ids[:, :5], kv_cache=cache, start_pos=0).logits]
        for t in range(5, 9):
            parts.append(model(ids[:, t : t + 1], kv_cache=cache, start_pos=t).logits)
        torch.testing.assert_close(torch.cat(parts, 1), want, rtol=1e-5, atol=1e-5)
        # rewinding the cache forgets the router state of the dropped positions
        again = model(ids[:, 6:9], kv_cache=cache, start_pos=6).logits
        torch.testing.assert_close(again, want[:, 6:9], rtol=1e-5, atol=1e-5)


def test_with_router_keeps_the_output_scale_of_a_normalised_model():
    torch.manual_seed(16)
    cfg = ModelConfig.tiny(n_layers=2)  # trained-style router: softmax, norm_topk_prob=True
    model = MoETransformer(cfg).eval()
    assert cfg.moe.router.norm_topk_prob
    ids = torch.randint(0, 64, (2, 8))
    # rate 0 + per-token cap k at the full budget is token choice: with the derived
    # normalisation the swapped model reproduces the trained one exactly
    tc_like = _usmoe(usmoe_rate=0.0, usmoe_constraint="per_token")
    swapped = with_router(model, tc_like)
    assert swapped.cfg.moe.router.usmoe_weight_norm == "selected"
    torch.testing.assert_close(swapped(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    raw = with_router(model, dataclasses.replace(tc_like, usmoe_weight_norm="none"))
    assert not torch.allclose(raw(ids).logits, model(ids).logits, atol=1e-3)
    cfg.moe.router = dataclasses.replace(cfg.moe.router, norm_topk_prob=False)
    unnorm = with_router(MoETransformer(cfg), _usmoe())
    assert unnorm.cfg.moe.router.usmoe_weight_norm == "none"


def test_configs_written_with_the_old_defaults_still_load():
    # before the per-position default, every router stored these USMoE-only fields
    old = RouterConfig(selection_scope="sequence", usmoe_weight_norm="none")
    assert (old.selection_scope, old.usmoe_weight_norm) == ("position", "auto")
    assert old == RouterConfig()
    with pytest.raises(ValueError, match="selection_scope: only used by kind='usmoe'"):
        RouterConfig(selection_scope="batch")
    assert _usmoe(selection_scope="sequence").selection_scope == "sequence"  # USMoE: kept
