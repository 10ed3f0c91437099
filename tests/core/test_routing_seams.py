"""Routing seams of the MoE layer: a router input separate from the expert input (context
routers), forced routing by expert ids or by a whole plan, additive logit noise, and the
expert-id checks of forced routing and router replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.plan import RoutingPlan
from moelab.core.replay import RouterReplay, record_routing, replay_routing
from moelab.errors import InvalidTypeError, InvalidValueError

D, F_, E = 8, 16, 4


def _layer(seed: int = 0, **router) -> MoELayer:
    torch.manual_seed(seed)
    router.setdefault("num_experts", E)
    router.setdefault("top_k", 2)
    cfg = MoEConfig(
        router=RouterConfig(**router),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=F_, init_std=0.3),
    )
    return MoELayer(cfg).eval()


def _expert(layer: MoELayer, e: int, x_TD: torch.Tensor) -> torch.Tensor:
    """Expert e of a SwiGLU bank on every row of x, written out (the slow reference)."""
    gu = x_TD @ layer.experts.w_gate_up[e]
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) * u) @ layer.experts.w_down[e]


def _reference(layer: MoELayer, x_TD, idx_Tk, w_Tk) -> torch.Tensor:
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for j in range(idx_Tk.shape[1]):
            e = int(idx_Tk[t, j])
            out[t] += w_Tk[t, j] * _expert(layer, e, x_TD[t : t + 1])[0]
    return out


def test_context_router_plan_depends_only_on_router_input():
    router_input_size = 5
    layer = _layer(input_size=router_input_size)
    assert layer.router.weight.shape == (E, router_input_size)
    B, S = 3, 6
    ctx = torch.randn(B, router_input_size)
    r = ctx[:, None].expand(B, S, router_input_size)
    x1, x2 = torch.randn(B, S, D), torch.randn(B, S, D)
    with torch.no_grad():
        p1, p2 = layer(x1, router_input=r).plan, layer(x2, router_input=r).plan
        p3 = layer(x1, router_input=torch.randn(B, S, router_input_size)).plan
    # same context, different tokens: the same routing (ids and weights), to the bit
    assert torch.equal(p1.expert_idx, p2.expert_idx) and torch.equal(p1.weight, p2.weight)
    assert not torch.equal(p1.weight, p3.weight)
    # every position of a sample takes its sample's experts
    idx = p1.expert_idx.view(B, S, 2)
    assert torch.equal(idx, idx[:, :1].expand(B, S, 2))
    # the logits are the context's: softmax(ctx · Wᵀ) top-2, checked by hand
    logits = ctx @ layer.router.weight.detach().T
    want = logits.softmax(-1).topk(2, dim=-1)
    assert torch.equal(idx[:, 0].sort(-1).values, want.indices.sort(-1).values)


def test_context_router_output_equals_the_reference():
    layer = _layer(1, input_size=3)
    x, r = torch.randn(10, D), torch.randn(10, 3)
    with torch.no_grad():
        out = layer(x, router_input=r)
        p = out.plan
        idx, w = p.expert_idx.view(10, 2), p.weight.view(10, 2)
        assert torch.allclose(out.hidden_states, _reference(layer, x, idx, w), atol=1e-5)


def test_router_input_errors():
    ctx_layer = _layer(input_size=5)
    x = torch.randn(2, 3, D)
    with pytest.raises(InvalidValueError, match="pass router_input"):
        ctx_layer(x)
    with pytest.raises(InvalidValueError, match=r"expected shape \(2, 3, 5\)"):
        ctx_layer(x, router_input=torch.randn(2, 5))  # per-sample context not broadcast
    with pytest.raises(InvalidTypeError, match="floating-point"):
        ctx_layer(x, router_input=torch.ones(2, 3, 5, dtype=torch.int64))


def test_forced_routing_equals_hand_built_plan():
    layer = _layer(2)
    T = 7
    x = torch.randn(T, D)
    ids = torch.tensor([[0, 1], [3, 2], [1, 1], [2, 0], [3, 3], [0, 2], [1, 3]])
    with torch.no_grad():
        forced = layer(x, expert_ids=ids)
        # weights: softmax over all E, taken at the forced experts, renormalised (k = 2)
        p = (x @ layer.router.weight.T).softmax(-1).gather(-1, ids)
        w = p / p.sum(-1, keepdim=True)
        assert torch.equal(forced.plan.expert_idx, ids.reshape(-1))
        assert torch.allclose(forced.plan.weight, w.reshape(-1), atol=1e-6)
        assert torch.allclose(forced.hidden_states, _reference(layer, x, ids, w), atol=1e-5)
        # the same routing given as a whole plan from outside
        plan = RoutingPlan(
            token_idx=torch.arange(T).repeat_interleave(2),
            expert_idx=ids.reshape(-1),
            weight=w.reshape(-1),
            logits=forced.plan.logits,
            probs=forced.plan.probs,
            num_experts=E,
            top_k=2,
        )
        by_plan = layer(x, plan=plan)
    assert torch.allclose(by_plan.hidden_states, forced.hidden_states, atol=1e-6)


def test_forced_routing_keeps_router_gradient_and_records():
    layer = _layer(3).train()
    x = torch.randn(2, 4, D)
    ids = torch.randint(0, E, (2, 4, 2))
    with record_routing(layer) as routes:
        out = layer(x, expert_ids=ids)
    assert torch.equal(routes["router"], ids.reshape(-1, 2))
    out.hidden_states.pow(2).sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_forced_routing_errors():
    layer = _layer()
    x = torch.randn(5, D)
    for bad in (-1, E):
        ids = torch.zeros(5, 2, dtype=torch.int64)
        ids[3, 1] = bad
        with pytest.raises(InvalidValueError, match=rf"expert id {bad} is outside \[0, {E}\)"):
            layer(x, expert_ids=ids)
    with pytest.raises(InvalidValueError, match=r"expected shape \(5, 2\)"):
        layer(x, expert_ids=torch.zeros(5, 1, dtype=torch.int64))
    with pytest.raises(InvalidTypeError, match="integer tensor"):
        layer(x, expert_ids=torch.zeros(5, 2))
    ec = _layer(kind="expert_choice")
    with pytest.raises(InvalidValueError, match="token-choice router"):
        ec(x, expert_ids=torch.zeros(5, 2, dtype=torch.int64))


def test_plan_from_outside_is_checked():
    layer = _layer()
    x = torch.randn(4, D)

    def plan(tokens, experts, weight=None, T=4, n_exp=E):
        n = len(tokens)
        return RoutingPlan(
            token_idx=torch.tensor(tokens),
            expert_idx=torch.tensor(experts),
            weight=torch.ones(n) if weight is None else weight,
            logits=torch.zeros(T, n_exp),
            probs=torch.full((T, n_exp), 1 / n_exp),
            num_experts=n_exp,
        )

    with pytest.raises(InvalidValueError, match="expert id 4 is outside"):
        layer(x, plan=plan([0, 1], [0, 4]))
    with pytest.raises(InvalidValueError, match="token_idx"):
        layer(x, plan=plan([0, 4], [0, 1]))
    with pytest.raises(InvalidValueError, match="routes 5 tokens to 4 experts"):
        layer(x, plan=plan([0], [0], T=5))
    with pytest.raises(InvalidValueError, match="finite"):
        layer(x, plan=plan([0], [0], weight=torch.tensor([float("nan")])))
    with pytest.raises(InvalidValueError, match="at most one"):
        layer(x, plan=plan([0], [0]), expert_ids=torch.zeros(4, 2, dtype=torch.int64))
    # a variable plan (token 2 gets no expert, token 0 two) computes exactly those pairs
    with torch.no_grad():
        y = layer(x, plan=plan([0, 0, 1, 3], [2, 3, 1, 0], torch.tensor([0.5, 0.25, 1.0, 2.0])))
        want = torch.zeros(4, D)
        want[0] = 0.5 * _expert(layer, 2, x[:1])[0] + 0.25 * _expert(layer, 3, x[:1])[0]
        want[1] = _expert(layer, 1, x[1:2])[0]
        want[3] = 2.0 * _expert(layer, 0, x[3:4])[0]
    assert torch.allclose(y.hidden_states, want, atol=1e-5)


def test_replay_checks_expert_ids():
    layer = _layer()
    x = torch.randn(6, D)
    with record_routing(layer) as routes:
        layer(x)
    for bad in (-1, E):
        ids = routes["router"].clone()
        ids[0, 0] = bad
        with (
            replay_routing(layer, {"router": ids}),
            pytest.raises(InvalidValueError, match=rf"replay: expert id {bad} is outside"),
        ):
            layer(x)
    with pytest.raises(InvalidTypeError, match="integer tensor"):
        RouterReplay("replay", routes["router"].float()).replayed(6, 2, E, "cpu")


def test_logit_noise_is_additive_gaussian_in_training_only():
    std = 0.5
    layer = _layer(4, logit_noise_std=std)
    x = torch.randn(4000, D)
    clean = x @ layer.router.weight.detach().T
    with torch.no_grad():
        assert torch.equal(layer.router.logits(x), clean)  # eval: no noise
        layer.train()
        torch.manual_seed(0)
        noisy = layer.router.logits(x)
        plan = layer.router(x)
    diff = (noisy - clean).flatten()
    assert abs(float(diff.mean())) < 0.02 and abs(float(diff.std()) - std) < 0.02
    # the noisy logits are the plan's: selection, weights and balance probs all see them
    assert torch.allclose(plan.probs, plan.logits.softmax(-1), atol=1e-6)
    assert not torch.equal(plan.logits, clean)


def test_new_router_fields_are_validated():
    with pytest.raises(InvalidValueError, match="logit_noise_std"):
        RouterConfig(logit_noise_std=-0.1)
    with pytest.raises(InvalidValueError, match="input_size"):
        RouterConfig(input_size=0)
