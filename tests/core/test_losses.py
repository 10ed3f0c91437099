import math

import pytest
import torch

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.losses import (
    GlobalBalanceLoss,
    SequenceBalanceLoss,
    router_z_loss,
    switch_balance_loss,
)
from moelab.core.plan import RoutingPlan

PROBS = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
ALL = torch.ones(2, dtype=torch.bool)


def plan_of(tokens, experts, probs=PROBS):
    n = len(tokens)
    return RoutingPlan(
        token_idx=torch.tensor(tokens),
        expert_idx=torch.tensor(experts),
        weight=torch.ones(n),
        logits=probs.log(),
        probs=probs,
        num_experts=probs.shape[1],
    )


def test_switch_loss_hand_values():
    # balanced top-1 routing: E·Σ f·P = 2·(0.5·0.6 + 0.5·0.4) = 1.0
    assert switch_balance_loss(PROBS, torch.tensor([1, 1]), ALL).item() == pytest.approx(1.0)
    # everything to expert 0: f = [1, 0], P0 = 0.6 → 1.2
    assert switch_balance_loss(PROBS, torch.tensor([2, 0]), ALL).item() == pytest.approx(1.2)
    # k = 2, both experts for both tokens: Megatron convention gives 1, HF gives k = 2
    counts = torch.tensor([2, 2])
    assert switch_balance_loss(PROBS, counts, ALL, "megatron").item() == pytest.approx(1.0)
    assert switch_balance_loss(PROBS, counts, ALL, "hf").item() == pytest.approx(2.0)


def test_switch_loss_excludes_padding():
    mask = torch.tensor([True, False])
    # only token 0 counts: P = [0.8, 0.2], its pair went to expert 1 → 2·(1·0.2) = 0.4
    plan = plan_of([0, 1], [1, 0])
    from moelab.core.losses import SwitchBalanceLoss

    assert SwitchBalanceLoss()(plan, mask, (2,)).item() == pytest.approx(0.4)
    assert (
        switch_balance_loss(PROBS, torch.tensor([0, 0]), torch.zeros(2, dtype=torch.bool)).item()
        == 0.0
    )


def test_sequence_loss_hand_value_and_mask():
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.5, 0.5]])
    plan = plan_of([0, 1, 2, 3], [0, 0, 1, 0], probs)
    mask = torch.ones(4, dtype=torch.bool)
    # seq 0 (tokens 0,1): f = [1, 0], P0 = 0.8 → 1.6; seq 1 (2,3): f = [.5, .5], P = [.35, .65] → 1.0
    assert SequenceBalanceLoss()(plan, mask, (2, 2)).item() == pytest.approx((1.6 + 1.0) / 2)
    # padding token 3: seq 1 = token 2 only: f = [0, 1], P1 = 0.8 → 1.6
    mask[3] = False
    assert SequenceBalanceLoss()(plan, mask, (2, 2)).item() == pytest.approx((1.6 + 1.6) / 2)
    # a fully padded sequence is left out of the mean
    mask = torch.tensor([True, True, False, False])
    assert SequenceBalanceLoss()(plan, mask, (2, 2)).item() == pytest.approx(1.6)


def test_global_loss_accumulates_counts_until_reset():
    loss = GlobalBalanceLoss()
    first = loss(plan_of([0, 1], [0, 0]), ALL, (2,))
    assert first.item() == pytest.approx(1.2)  # counts [2, 0]
    loss.commit()  # the training loop commits once per micro-batch, outside forward
    second = loss(plan_of([0, 1], [1, 1]), ALL, (2,))
    assert second.item() == pytest.approx(1.0)  # accumulated counts [2, 2]
    loss.reset()
    assert loss(plan_of([0, 1], [1, 1]), ALL, (2,)).item() == pytest.approx(0.8)  # [0, 2]


def test_z_loss_hand_value_and_mask():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    want = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert router_z_loss(logits, ALL).item() == pytest.approx(want)
    assert router_z_loss(logits, torch.tensor([True, False])).item() == pytest.approx(
        math.log(2) ** 2
    )


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_gradient_reaches_router_and_matches_formula(score_func):
    torch.manual_seed(0)
    E, k, D = 6, 2, 5
    coeff = 0.1
    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=E, top_k=k, score_func=score_func),
            experts=ExpertsConfig(D, 8),
            losses=LossConfig(aux_loss_coeff=coeff, z_loss_coeff=0.0),
        )
    )
    x = torch.randn(11, D)
    out = layer(x)
    (grad,) = torch.autograd.grad(out.aux_losses["load_balance"], layer.router.weight)
    assert grad.abs().sum() > 0
    # the formula by hand: counts are constants, P is differentiable
    W = layer.router.weight.detach().clone().requires_grad_()
    logits = x @ W.t()
    if score_func == "softmax":
        p = logits.softmax(-1)
    else:
        s = logits.sigmoid()
        p = s / s.sum(-1, keepdim=True)
    counts = out.record.counts.float()
    want = coeff * E * ((counts / (11 * k)) * p.mean(0)).sum()
    torch.testing.assert_close(out.aux_losses["load_balance"], want)
    (want_grad,) = torch.autograd.grad(want, W)
    torch.testing.assert_close(grad, want_grad)


def test_perfectly_balanced_routing_gives_one_and_hf_gives_k():
    E, k, T = 4, 2, 8
    tokens = torch.arange(T).repeat_interleave(k)
    experts = torch.arange(T * k) % E
    probs = torch.full((T, E), 1 / E)
    plan = RoutingPlan(tokens, experts, torch.ones(T * k), probs.log(), probs, E)
    mask = torch.ones(T, dtype=torch.bool)
    counts = plan.counts(mask)
    assert switch_balance_loss(probs, counts, mask).item() == pytest.approx(1.0)
    assert switch_balance_loss(probs, counts, mask, "hf").item() == pytest.approx(k)
