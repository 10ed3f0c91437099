"""BR-MoE: the fused experts equal the per-expert adapters, router selection follows the
latent heads' entropy, and growing freezes the old experts bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.methods.continual.brmoe import BRMoE, entropy, topk_mask

from ._tiny import tiny_learner

D = 8


def _moe(num_experts: int, topk_routers: int, topk_experts: int = 3) -> BRMoE:
    torch.manual_seed(0)
    moe = BRMoE(D, expert_dim=4, shared_dim=4, topk_experts=topk_experts, topk_routers=topk_routers)
    for _ in range(num_experts):
        moe.grow(2)
    with torch.no_grad():
        for e in moe.experts:
            e.scale.normal_()  # a fresh expert outputs zeros: give each a visible output
            e.up.bias.normal_()
        moe.shared.scale.normal_()
        for e, head in enumerate(moe.latent_heads):
            head[1].weight.zero_()
            # head 1 is confident (low entropy), the others uniform (entropy ln 2)
            head[1].bias.copy_(torch.tensor([6.0, -6.0]) if e == 1 else torch.zeros(2))
    return moe.eval()


def _reference(moe: BRMoE, a, mask, routers):
    """Per-expert loop: Σ_r softmax(topk(router_r(token_r))) · expert outputs + shared."""
    outs = torch.stack([e(a) for e in moe.experts])  # [E, B, S, D]
    m = mask[None, :, :, None].float()
    tokens = (outs * m).sum(2) / m.sum(2)  # [E, B, D]
    E = len(moe.experts)
    w = torch.zeros(a.shape[0], E)
    for r in routers:
        s = moe.routers[r](tokens[r])
        s = torch.cat([s, s.new_full((s.shape[0], E - s.shape[1]), -math.inf)], -1)
        w += torch.softmax(topk_mask(s, moe.topk_experts), -1)
    return torch.einsum("be,ebsd->bsd", w, outs) + moe.shared(a)


def test_test_time_selection_picks_the_lowest_entropy_router():
    moe = _moe(3, topk_routers=1)
    a = torch.randn(4, 5, D)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[0, 3:] = False
    delta, side = moe(a, mask)
    assert side.routers.tolist() == [[1, 1, 1, 1]]
    assert side.entropies[0].tolist() == pytest.approx([math.log(2)] * 4, abs=1e-6)
    assert side.entropies[1].max() < 1e-3
    torch.testing.assert_close(delta, _reference(moe, a, mask, [1]))


def test_training_selection_is_the_best_old_router_plus_the_current_one():
    moe = _moe(3, topk_routers=2)
    a = torch.randn(3, 4, D)
    mask = torch.ones(3, 4, dtype=torch.bool)
    delta, side = moe(a, mask, task=2)
    assert side.routers.tolist() == [[1, 1, 1], [2, 2, 2]]
    assert torch.equal(side.latent, torch.zeros(3, 2))  # head 2: zero weight and bias
    torch.testing.assert_close(delta, _reference(moe, a, mask, [1, 2]))


def test_top_k_experts_masks_to_minus_100():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert topk_mask(x, 2).tolist() == [[-100.0, 3.0, 2.0, -100.0]]
    assert entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4), abs=1e-6)


def test_one_expert_is_expert_zero_and_fresh_moe_adds_zeros():
    torch.manual_seed(0)
    moe = BRMoE(D, 4, 4)
    moe.grow(2)
    a = torch.randn(2, 3, D)
    delta, side = moe.eval()(a, torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(delta, torch.zeros_like(delta)) and side.routers is None


def test_new_expert_is_the_mean_of_all_but_the_newest():
    moe = _moe(3, topk_routers=2)
    moe.grow(2)
    for name, p in moe.experts[3].named_parameters():
        mean = (moe.experts[0].get_parameter(name) + moe.experts[1].get_parameter(name)) / 2
        torch.testing.assert_close(p, mean)


def test_a_new_task_leaves_old_experts_bit_identical():
    learner = tiny_learner("care")
    learner.learn(0)
    learner.learn(1)
    old = [
        {k: v.clone() for k, v in layer.experts[i].state_dict().items()}
        for layer in learner.layers
        for i in range(2)
    ] + [
        {k: v.clone() for k, v in layer.routers[0].state_dict().items()} for layer in learner.layers
    ]
    shared = learner.layers[0].shared.down.weight.clone()
    learner.learn(2)
    now = [layer.experts[i].state_dict() for layer in learner.layers for i in range(2)] + [
        layer.routers[0].state_dict() for layer in learner.layers
    ]
    for before, after in zip(old, now, strict=True):
        for k in before:
            assert torch.equal(before[k], after[k]), k
    assert not torch.equal(shared, learner.layers[0].shared.down.weight)  # the shared one trains
    assert all(
        not p.requires_grad for layer in learner.layers for p in layer.experts[1].parameters()
    )
