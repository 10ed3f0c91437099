"""PA-MoE's phase router and its losses (moelab.core.routers.phase, moelab.core.losses.phase)."""

import math

import pytest
import torch
import torch.nn.functional as F

from moelab import ExpertsConfig, MoEConfig, MoELayer, RouterConfig
from moelab.core.config import LossConfig
from moelab.core.losses.phase import (
    expert_diversity_loss,
    reinforce_loss,
    switch_shaped_advantages,
    switching_probability,
    uniform_balance_loss,
)
from moelab.core.plan import RoutingPlan
from moelab.core.routers.phase import PhaseRouter, linear_temperature, sample_experts, step_plan
from moelab.errors import InvalidValueError


def test_temperature_schedule_endpoints_and_midpoint():
    assert linear_temperature(0) == 2.0
    assert linear_temperature(1500) == pytest.approx(1.25)
    assert linear_temperature(3000) == 0.5
    assert linear_temperature(10_000) == 0.5  # held at τf after K updates
    assert linear_temperature(5, 1.0, 0.2, 10) == pytest.approx(0.6)


def test_router_gives_one_expert_per_step_and_greedy_is_argmax():
    torch.manual_seed(0)
    router = PhaseRouter(
        obs_size=6, goal_size=5, history_size=7, num_experts=4, hidden_size=8, num_heads=2
    )
    B = 9
    mask = torch.ones(B, 3, dtype=torch.bool)
    mask[0, 2] = False
    logits = router(torch.randn(B, 10, 6), torch.randn(B, 3, 5), mask, torch.randn(B, 5, 7))
    assert logits.shape == (B, 4) and logits.dtype == torch.float32
    idx, logp = sample_experts(logits, 0.5, greedy=True)
    assert torch.equal(idx, logits.argmax(-1))
    torch.testing.assert_close(logp, F.log_softmax(logits / 0.5, -1).gather(-1, idx[:, None])[:, 0])
    plan = step_plan(idx, logits)
    assert plan.num_pairs == B and plan.top_k == 1
    assert torch.equal(plan.token_idx, torch.arange(B)) and torch.equal(plan.expert_idx, idx)
    assert torch.equal(plan.counts(), torch.bincount(idx, minlength=4))
    assert torch.equal(plan.weight, torch.ones(B))


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(20_000, 2)
    g = torch.Generator().manual_seed(0)
    idx, _ = sample_experts(logits, 1.0, greedy=False, generator=g)
    assert idx.float().mean().item() == pytest.approx(0.75, abs=0.01)
    idx, _ = sample_experts(logits, 2.0, greedy=False, generator=g)  # softmax(ℓ/2): √3/(1+√3)
    assert idx.float().mean().item() == pytest.approx(math.sqrt(3) / (1 + math.sqrt(3)), abs=0.01)


def test_forced_step_plan_equals_hand_built_plan_and_expert_maths():
    torch.manual_seed(1)
    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=3, top_k=1),
            experts=ExpertsConfig(hidden_size=8, ffn_hidden_size=5, activation="gelu"),
            losses=LossConfig(load_balance="none", z_loss_coeff=0.0),
        )
    )
    x = torch.randn(6, 8)
    e = torch.tensor([2, 0, 0, 1, 2, 2])
    logits = torch.randn(6, 3)
    hand = RoutingPlan(
        token_idx=torch.arange(6),
        expert_idx=e,
        weight=torch.ones(6),
        logits=logits,
        probs=logits.softmax(-1),
        num_experts=3,
    )
    y = layer(x, plan=step_plan(e, logits)).hidden_states
    torch.testing.assert_close(y, layer(x, plan=hand).hidden_states)
    w_up, w_down = layer.experts.w_up, layer.experts.w_down
    ref = torch.stack([F.gelu(x[t] @ w_up[e[t]]) @ w_down[e[t]] for t in range(6)])
    torch.testing.assert_close(y, ref)


def test_switch_cost_hits_exactly_the_switching_steps():
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    experts = torch.tensor([0, 0, 2, 2, 1, 3])
    start = torch.tensor([True, False, False, False, True, False])  # episodes [0:4], [4:6]
    out = switch_shaped_advantages(adv, experts, start, 0.05)
    # switch at step 2 (0→2) and 5 (1→3); step 4 changes expert but starts an episode
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.95, 1.0, 1.0, 0.95]))


def test_switching_cost_trains_the_router_to_hold_its_expert():
    """REINFORCE with zero task advantage and the switching cost: the sampled routing of a
    20-step episode switches far less after training (temporal consistency)."""
    torch.manual_seed(0)
    T, E = 20, 4
    logits = torch.zeros(T, E, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    start = torch.zeros(T, dtype=torch.bool)
    start[0] = True
    g = torch.Generator().manual_seed(0)

    def switches(n: int) -> float:
        with torch.no_grad():
            total = 0
            for _ in range(n):
                e, _ = sample_experts(logits, 1.0, greedy=False, generator=g)
                total += int((e[1:] != e[:-1]).sum())
            return total / n

    before = switches(200)
    assert before == pytest.approx((T - 1) * (1 - 1 / E), rel=0.1)  # uniform routing
    for _ in range(500):
        e, logp = sample_experts(logits, 1.0, greedy=False, generator=g)
        adv = switch_shaped_advantages(torch.zeros(T), e, start, 0.5)
        opt.zero_grad()
        reinforce_loss(logp, adv - adv.mean()).backward()
        opt.step()
    assert switches(200) < before / 3


def test_balance_and_switching_surrogate_values():
    assert uniform_balance_loss(torch.full((5, 4), 0.25)).item() == pytest.approx(0.0)
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # f̄ = (1, 0): (1/2)² + (1/2)²
    assert uniform_balance_loss(p).item() == pytest.approx(0.5)
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    same = torch.tensor([True, True, False])
    # pairs (0,1): 1 − 0.5; (1,2): 1 − 0.5
    assert switching_probability(probs, same).item() == pytest.approx(0.5)
    assert switching_probability(probs, torch.tensor([False, True, False])).item() == pytest.approx(
        0.5
    )


def test_diversity_loss_by_hand():
    # experts 0 and 1 identical (KL 0 < τ), expert 2 far from both
    near = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    far = torch.log(torch.tensor([[0.01, 0.99], [0.01, 0.99]]))
    logp = torch.stack([near, near, far])  # [E=3, B=2, A=2]
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    # only pair (0,1) is close: (0.1 − 0)·mean(0.25, 0.0625)
    expected = 0.1 * (0.25 + 0.0625) / 2
    assert expert_diversity_loss(logp, probs, 0.1).item() == pytest.approx(expected)
    assert expert_diversity_loss(torch.stack([far, near]), probs[:, :2], 0.1).item() == 0.0


def test_bad_inputs_raise():
    with pytest.raises(InvalidValueError, match="temperature"):
        sample_experts(torch.zeros(2, 3), 0.0, greedy=True)
    with pytest.raises(InvalidValueError, match="expert_idx"):
        step_plan(torch.tensor([0, 3]), torch.zeros(2, 3))
    with pytest.raises(InvalidValueError, match="steps"):
        linear_temperature(1, steps=0)
    with pytest.raises(InvalidValueError, match="num_heads"):
        PhaseRouter(4, 4, 4, 2, hidden_size=6, num_heads=4)
    router = PhaseRouter(4, 4, 4, 2, hidden_size=8, num_heads=2)
    with pytest.raises(InvalidValueError, match="goal_mask_BM"):
        router(
            torch.zeros(2, 3, 4),
            torch.zeros(2, 2, 4),
            torch.tensor([[True, False], [False, False]]),
            torch.zeros(2, 5, 4),
        )
    with pytest.raises(InvalidValueError, match="cost"):
        switch_shaped_advantages(
            torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.bool), -1
        )
