"""Router features of issue 9 against references: Sinkhorn routing (Megatron-Core's
algorithm, written out here in float64), sqrtsoftplus scores, forced uniform assignment and
router replay."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.replay import record_routing, replay_routing
from moelab.core.routers import SinkhornRouter, TopKRouter, sinkhorn
from moelab.models import ModelConfig, MoETransformer


def _megatron_sinkhorn(cost, tol=1e-4):
    """Megatron-Core ``moe_utils.sinkhorn`` (float64, on exp(logits) directly)."""
    cost = torch.exp(cost.double())
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    eps = 1e-8
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def test_sinkhorn_matches_megatron_and_balances():
    torch.manual_seed(0)
    logits = torch.randn(24, 6) * 2 + torch.tensor([3.0, 0, 0, 0, 0, -2])
    got = sinkhorn(logits)
    want = _megatron_sinkhorn(logits)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-9)
    assert torch.allclose(got.sum(1), torch.full((24,), 1 / 24), rtol=1e-3)
    assert torch.allclose(got.sum(0), torch.full((6,), 1 / 6), rtol=1e-3)
    # shifting every logit leaves the balanced matrix unchanged (and cannot overflow)
    assert torch.allclose(sinkhorn(logits + 200.0), got, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_router_follows_megatron(k):
    torch.manual_seed(1)
    T, D, E = 32, 5, 4
    # Megatron's activation: sigmoid for k = 1, softmax (unnormalised top-k) for k > 1
    score = "sigmoid" if k == 1 else "softmax"
    cfg = RouterConfig(
        num_experts=E, top_k=k, kind="sinkhorn", score_func=score, norm_topk_prob=False
    )
    router = SinkhornRouter(cfg, D, init_std=1.0)
    with torch.no_grad():
        router.weight[0] += 2.0  # expert 0 is everyone's favourite before balancing
    x = torch.randn(T, D) + 1.0
    router.train()
    plan = router(x)
    logits = plan.logits.detach()
    idx = _megatron_sinkhorn(logits).topk(k, dim=1).indices
    act = logits.sigmoid() if k == 1 else logits.softmax(-1)
    assert plan.expert_idx.view(T, k).tolist() == idx.tolist()
    assert torch.allclose(plan.weight.view(T, k), act.gather(1, idx))
    greedy = act.topk(k, dim=1).indices
    train_load = torch.bincount(idx.reshape(-1), minlength=E)
    greedy_load = torch.bincount(greedy.reshape(-1), minlength=E)
    assert train_load.max() < greedy_load.max()  # balancing did something
    router.eval()
    assert router(x).expert_idx.view(T, k).tolist() == greedy.tolist()


def test_forced_uniform_assignment_is_exactly_balanced():
    cfg = RouterConfig(num_experts=6, top_k=2, force_uniform=True)
    router = TopKRouter(cfg, 4)
    plan = router(torch.randn(9, 4))
    assert torch.bincount(plan.expert_idx, minlength=6).tolist() == [3, 3, 3, 3, 3, 3]
    idx = plan.expert_idx.view(9, 2)
    assert (idx[:, 0] != idx[:, 1]).all()
    p = plan.logits.softmax(-1).gather(1, idx)
    assert torch.allclose(plan.weight.view(9, 2), p / p.sum(-1, keepdim=True))


def test_router_replay_reproduces_recorded_routing_with_fresh_weights():
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=40, n_layers=2)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 40, (2, 7))
    with record_routing(model) as routes:
        first = model(ids)
    assert set(routes) == {"blocks.0.ffn.router", "blocks.1.ffn.router"}
    recorded = [p.expert_idx.clone() for p in first.plans]
    # the trainer's weights drift: without replay the routing changes
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.router.weight.mul_(-1.0)
    drifted = model(ids)
    assert any(
        not torch.equal(p.expert_idx, r) for p, r in zip(drifted.plans, recorded, strict=True)
    )
    with replay_routing(model, routes):
        again = model(ids)
    for plan, want in zip(again.plans, recorded, strict=True):
        assert torch.equal(plan.expert_idx, want)
        # weights are the current router's softmax at the replayed experts, renormalised
        T = plan.logits.shape[0]
        p = plan.logits.softmax(-1).gather(1, want.view(T, 2))
        assert torch.allclose(plan.weight.view(T, 2), p / p.sum(-1, keepdim=True))
    again.logits.sum().backward()
    assert model.blocks[0].ffn.router.weight.grad.abs().max() > 0
    # outside the block routing is the router's own again
    assert torch.equal(model(ids).plans[0].expert_idx, drifted.plans[0].expert_idx)


def test_replay_of_another_batch_is_refused():
    model = MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=1))
    with record_routing(model) as routes:
        model(torch.randint(0, 40, (1, 5)))
    with replay_routing(model, routes), pytest.raises(ValueError, match="same batch"):
        model(torch.randint(0, 40, (1, 6)))
    with pytest.raises(ValueError, match="match"), replay_routing(model, {}):
        pass


def test_sqrtsoftplus_weights_follow_deepseek_v4_formula():
    torch.manual_seed(0)
    cfg = RouterConfig(num_experts=5, top_k=2, score_func="sqrtsoftplus", routed_scaling_factor=1.5)
    router = TopKRouter(cfg, 3, init_std=1.0)
    plan = router(torch.randn(4, 3))
    s = torch.log1p(plan.logits.double().exp()).sqrt()
    idx = s.topk(2, dim=-1).indices
    w = s.gather(1, idx)
    w = 1.5 * w / w.sum(-1, keepdim=True)
    assert plan.expert_idx.view(4, 2).tolist() == idx.tolist()
    assert torch.allclose(plan.weight.view(4, 2).double(), w, rtol=1e-5)


def test_layer_with_sinkhorn_router_runs_forward_and_backward():
    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2, kind="sinkhorn"),
            experts=ExpertsConfig(hidden_size=6, ffn_hidden_size=8),
        )
    )
    out = layer(torch.randn(2, 5, 6))
    out.hidden_states.sum().backward()
    assert layer.router.weight.grad is not None
