import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.core import checks
from moelab.core.config import RouterConfig
from moelab.core.routers import ExpertChoiceRouter, TopKRouter, update_expert_bias
from moelab.core.routers.capacity import expert_capacity

from .reference import plan_routes, ref_capacity, ref_drop, ref_expert_choice, ref_token_choice


def _close_routes(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = sorted(w)
        assert [e for e, _ in g] == [e for e, _ in w]
        for (_, a), (_, b) in zip(g, w, strict=True):
            assert a == pytest.approx(b, abs=tol, rel=tol)


@st.composite
def token_choice_cases(draw):
    groups = draw(st.sampled_from([None, (2, 1), (2, 2), (4, 2)]))
    E = draw(st.sampled_from([4, 8])) if groups else draw(st.integers(1, 9))
    if groups:
        n_group, topk_group = groups
        k = draw(st.integers(1, topk_group * (E // n_group)))
    else:
        n_group = topk_group = None
        k = draw(st.integers(1, E))
    cfg = RouterConfig(
        num_experts=E,
        top_k=k,
        score_func=draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"])),
        softmax_before_topk=draw(st.booleans()),
        group_score=draw(st.sampled_from(["top2", "topk_per_group"])),
        norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        n_group=n_group,
        topk_group=topk_group,
        expert_bias=draw(st.booleans()),
    )
    T = draw(st.integers(0, 12))
    D = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 10_000))
    return cfg, T, D, seed


@settings(max_examples=60, deadline=None)
@given(token_choice_cases())
def test_token_choice_matches_reference(case):
    cfg, T, D, seed = case
    torch.manual_seed(seed)
    router = TopKRouter(cfg, D, init_std=1.0)
    if cfg.expert_bias:
        router.expert_bias.normal_(0, 0.3)
    x = torch.randn(T, D)
    plan = router(x)
    assert plan.num_pairs == T * cfg.top_k
    want = ref_token_choice(plan.logits, cfg, router.expert_bias)
    _close_routes(plan_routes(plan), want)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 16),
    E=st.integers(1, 6),
    kf=st.floats(0.0, 1.0),
    cf=st.sampled_from([0.25, 0.5, 1.0, 1.5]),
    policy=st.sampled_from(["probs", "position"]),
    seed=st.integers(0, 10_000),
)
def test_capacity_dropping_matches_reference(T, E, kf, cf, policy, seed):
    k = 1 + int(kf * (E - 1))
    cfg = RouterConfig(num_experts=E, top_k=k, capacity_factor=cf, drop_policy=policy)
    torch.manual_seed(seed)
    router = TopKRouter(cfg, 4, init_std=1.0)
    plan = router(torch.randn(T, 4))
    C = ref_capacity(T, k, E, cf)
    want = ref_drop(ref_token_choice(plan.logits, cfg), E, C, policy)
    _close_routes(plan_routes(plan), want)
    assert plan.dropped == T * k - plan.num_pairs
    assert plan.counts().max().item() <= C


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(0, 12),
    E=st.integers(2, 6),
    cf=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 9999),
)
def test_expert_choice_matches_reference(T, E, cf, seed):
    k = min(2, E)
    cfg = RouterConfig(num_experts=E, top_k=k, kind="expert_choice", capacity_factor=cf)
    torch.manual_seed(seed)
    plan = ExpertChoiceRouter(cfg, 3, init_std=1.0)(torch.randn(T, 3))
    C = ref_capacity(T, k, E, cf)
    assert plan.num_pairs == E * C
    _close_routes(plan_routes(plan), ref_expert_choice(plan.logits, k, cf))


def test_expert_choice_single_expert_takes_capacity_tokens_with_weight_one():
    cfg = RouterConfig(num_experts=1, top_k=1, kind="expert_choice", capacity_factor=0.5)
    plan = ExpertChoiceRouter(cfg, 3)(torch.randn(6, 3))
    assert plan.num_pairs == 3
    assert torch.equal(plan.weight, torch.ones(3))
    assert len(set(plan.token_idx.tolist())) == 3


def test_capacity_formula_and_clamp():
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 2, 4, 1.25) == 7  # ceil(6.25)
    assert expert_capacity(3, 2, 2, 10.0) == 3  # clamped to T
    assert expert_capacity(1, 1, 8, 0.1) == 1  # at least one
    assert expert_capacity(0, 2, 4, 1.0) == 0


def test_top1_normalised_weights_are_exactly_one():
    from moelab.core.routers.scores import router_scores, topk_weights

    for score_func in ("softmax", "sigmoid"):
        cfg = RouterConfig(num_experts=5, top_k=1, score_func=score_func, norm_topk_prob=True)
        logits = torch.randn(7, 5) * 10
        w, idx = topk_weights(logits, router_scores(logits, score_func), None, cfg)
        assert w.shape == (7, 1) and idx.shape == (7, 1)
        assert torch.equal(w, torch.ones(7, 1))


def test_bf16_input_gives_fp32_router_and_same_topk():
    torch.manual_seed(0)
    cfg = RouterConfig(num_experts=8, top_k=2)
    router = TopKRouter(cfg, 16)
    # Well-separated scores: each token strongly prefers two experts.
    w = torch.zeros(8, 16)
    w[torch.arange(8), torch.arange(8)] = 4.0
    w[torch.arange(8), torch.arange(8) + 8] = 2.0
    router.weight.data.copy_(w)
    x = torch.zeros(32, 16)
    x[torch.arange(32), torch.arange(32) % 16] = 1.0
    x[torch.arange(32), (torch.arange(32) + 3) % 16] = 0.5
    p32 = router(x)
    p16 = router(x.bfloat16())
    assert p16.logits.dtype == torch.float32 and p16.weight.dtype == torch.float32
    assert torch.equal(p16.expert_idx, p32.expert_idx)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_experts": 4, "top_k": 5}, "top_k"),
        ({"num_experts": 4, "top_k": 0}, "top_k"),
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts": 6, "n_group": 4, "topk_group": 1}, "n_group"),
        ({"num_experts": 8, "n_group": 4, "topk_group": 5}, "topk_group"),
        ({"num_experts": 8, "top_k": 5, "n_group": 4, "topk_group": 2}, "top_k"),
        ({"num_experts": 8, "n_group": 4}, "n_group"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"score_func": "relu"}, "score_func"),
        ({"kind": "expert_choice", "expert_bias": True}, "kind"),
    ],
)
def test_invalid_router_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RouterConfig(**kwargs)


def test_bias_changes_selection_not_weights():
    cfg = RouterConfig(
        num_experts=4, top_k=1, score_func="sigmoid", norm_topk_prob=False, expert_bias=True
    )
    router = TopKRouter(cfg, 4)
    router.weight.data.copy_(torch.eye(4))
    x = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    assert router(x).expert_idx.tolist() == [0]
    router.expert_bias.copy_(torch.tensor([0.0, 0.5, 0.0, 0.0]))
    plan = router(x)
    assert plan.expert_idx.tolist() == [1]
    assert plan.weight.item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item())


def test_bias_update_rule_exact_counts():
    cfg = RouterConfig(num_experts=4, top_k=1, expert_bias=True, bias_update_rate=0.01)
    router = TopKRouter(cfg, 4)
    before = router.expert_bias.clone()
    router.train()
    router(torch.randn(16, 4))  # forward never changes the bias
    assert torch.equal(router.expert_bias, before)
    update_expert_bias(router, torch.tensor([3, 1, 2, 2]))  # mean 2
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    with pytest.raises(ValueError, match="counts"):
        update_expert_bias(router, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match="router"):
        update_expert_bias(TopKRouter(RouterConfig(num_experts=4), 4), torch.tensor([1, 1, 1, 1]))


def test_jitter_only_in_training():
    cfg = RouterConfig(num_experts=4, top_k=2, jitter_eps=0.1)
    router = TopKRouter(cfg, 8)
    x = torch.randn(5, 8)
    router.eval()
    assert torch.equal(router(x).logits, router(x).logits)
    router.train()
    torch.manual_seed(0)
    a = router(x).logits
    assert not torch.equal(a, router(x).logits)
    assert torch.allclose(a, x @ router.weight.t(), rtol=0.35, atol=0.35)


def test_nan_input_is_rejected():
    router = TopKRouter(RouterConfig(num_experts=4, top_k=2), 3)
    with checks.enabled(), pytest.raises(ValueError, match="NaN"):
        router(torch.tensor([[0.0, float("nan"), 1.0]]))
