import math

import pytest
import torch

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.losses import (
    CrossLayerLoss,
    coactivated_pairs,
    joint_topk_loss,
    pathway_loss,
    specialization_loss,
)
from moelab.core.plan import RoutingPlan
from moelab.models import ModelConfig, MoETransformer


def _layer(spec=True, penalty="square", E=4, k=2, D=8, F=6, shared=0):
    return MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=E, top_k=k),
            experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=F, shared_expert_size=shared),
            losses=LossConfig(
                specialization=spec,
                specialization_coeff=1.0,
                specialization_penalty=penalty,
                z_loss_coeff=0.0,
                load_balance="none",
            ),
        )
    )


def test_identical_experts_give_k_times_k_minus_one():
    torch.manual_seed(0)
    layer = _layer(shared=4)
    with torch.no_grad():
        layer.experts.w_gate_up.copy_(
            layer.experts.w_gate_up[:1].expand_as(layer.experts.w_gate_up)
        )
    out = layer(torch.randn(2, 5, 8))
    # every token has k(k−1) = 2 ordered pairs with cos² = 1
    assert out.aux_losses["specialization"].item() == pytest.approx(2.0, abs=1e-5)


def test_orthogonal_activations_give_zero_and_hand_values():
    a = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 3.0], [1.0, 1.0, 0]])
    tok = torch.tensor([0, 0, 1, 1])
    assert specialization_loss(a[:2], tok[:2]).item() == 0.0
    # token 1: cos((0,0,3), (1,1,0)) = 0; token 0: 0 -> mean 0
    assert specialization_loss(a, tok).item() == 0.0
    b = torch.tensor([[1.0, 0], [1.0, 1.0], [-1.0, 0]])
    tb = torch.tensor([0, 0, 0])  # pairs: (0,1) c=1/√2, (0,2) c=-1, (1,2) c=-1/√2
    c = [1 / math.sqrt(2), -1.0, -1 / math.sqrt(2)]
    # one token: the sum over its 6 ordered pairs
    assert specialization_loss(b, tb, penalty="square").item() == pytest.approx(
        2 * sum(x * x for x in c)
    )
    assert specialization_loss(b, tb, penalty="cos").item() == pytest.approx(2 * sum(c))
    assert specialization_loss(b, tb, penalty="relu").item() == pytest.approx(2 * c[0])
    # two tokens, the second with one expert: the first token's sum averaged over 2 tokens
    b2, t2 = torch.cat([b, torch.ones(1, 2)]), torch.tensor([0, 0, 0, 1])
    assert specialization_loss(b2, t2).item() == pytest.approx(sum(x * x for x in c))
    mask = torch.tensor([False])
    assert specialization_loss(b, tb, mask).item() == 0.0


def test_coactivated_pairs_any_order():
    i, j = coactivated_pairs(torch.tensor([2, 0, 2, 1, 0, 2]))
    got = sorted(tuple(sorted(p)) for p in zip(i.tolist(), j.tolist(), strict=True))
    assert got == [(0, 2), (0, 5), (1, 4), (2, 5)]


def test_specialization_gradient_reaches_experts_only_when_on():
    torch.manual_seed(1)
    layer = _layer()
    out = layer(torch.randn(3, 4, 8))
    out.aux_losses["specialization"].backward()
    assert layer.experts.w_gate_up.grad.abs().sum() > 0
    off = _layer(spec=False)
    assert "specialization" not in off(torch.randn(3, 4, 8)).aux_losses
    # the default path returns the outputs of the loss path (which needs the activations, so
    # it runs the PyTorch loop, not the fused kernel: equal up to float32 rounding)
    off.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(off(x).hidden_states, layer(x).hidden_states, rtol=1e-6, atol=1e-6)


def _plan(probs, k):
    T, E = probs.shape
    idx = probs.topk(k, -1).indices
    return RoutingPlan(
        token_idx=torch.arange(T).repeat_interleave(k),
        expert_idx=idx.reshape(-1),
        weight=torch.ones(T * k),
        logits=probs.log(),
        probs=probs,
        num_experts=E,
    )


def test_cross_layer_pathway_hand_value():
    p1 = torch.tensor([[0.8, 0.2], [0.1, 0.9]])
    p2 = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    # J = (p1ᵀ p2)/2 = [[0.30, 0.15], [0.215, 0.285]] / ... computed by hand:
    J = [
        [(0.8 * 0.7 + 0.1 * 0.4) / 2, (0.8 * 0.3 + 0.1 * 0.6) / 2],
        [(0.2 * 0.7 + 0.9 * 0.4) / 2, (0.2 * 0.3 + 0.9 * 0.6) / 2],
    ]
    want = 1 - (max(J[0]) + max(J[1]))  # k = 1
    assert pathway_loss(p1, p2, 1).item() == pytest.approx(want, abs=1e-7)
    assert want == pytest.approx(1 - (0.30 + 0.30), abs=1e-9)
    loss = CrossLayerLoss("pathway")([_plan(p1, 1), _plan(p2, 1)], top_k=1)
    assert loss.item() == pytest.approx(want, abs=1e-7)
    tok = CrossLayerLoss("token")([_plan(p1, 1), _plan(p2, 1)])
    assert tok.item() == pytest.approx(-(math.log(0.8 * 0.7) + math.log(0.9 * 0.6)) / 2, abs=1e-6)
    # pathways that are already deterministic give 0
    one_hot = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert pathway_loss(one_hot, one_hot.flip(1), 1).item() == 0.0


def test_model_level_losses_combine_and_reach_routers():
    torch.manual_seed(2)
    cfg = ModelConfig.tiny(n_layers=3)
    cfg.moe.losses = LossConfig(
        specialization=True, cross_layer=True, specialization_coeff=0.5, cross_layer_coeff=0.5
    )
    model = MoETransformer(cfg)
    ids = torch.randint(0, 64, (2, 8))
    out = model(ids)
    assert set(out.aux_losses) == {"load_balance", "z_loss", "specialization", "cross_layer"}
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    assert len(out.plans) == 3 and all(p is not None for p in out.plans)
    out.aux_losses["cross_layer"].backward()
    for block in model.blocks:
        assert block.ffn.router.weight.grad.abs().sum() > 0
    plans = [p for p in model(ids).plans]
    want = sum(joint_topk_loss(plans[i], plans[i + 1]) for i in range(2)) / 2
    assert model(ids).aux_losses["cross_layer"].item() == pytest.approx(0.5 * want.item(), rel=1e-5)


def test_loss_config_errors():
    with pytest.raises(ValueError, match="cross_layer_variant"):
        LossConfig(cross_layer_variant="both")
    with pytest.raises(ValueError, match="specialization_coeff"):
        LossConfig(specialization_coeff=-1.0)


def test_joint_topk_hand_value_eq7():
    p1 = torch.tensor([[0.8, 0.2], [0.1, 0.9]])
    p2 = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    # per token the product of the routed masses (k=1): 0.8·0.7 and 0.9·0.6
    want = 1 - (0.8 * 0.7 + 0.9 * 0.6) / 2
    assert joint_topk_loss(_plan(p1, 1), _plan(p2, 1)).item() == pytest.approx(want, abs=1e-7)
    assert CrossLayerLoss()([_plan(p1, 1), _plan(p2, 1)]).item() == pytest.approx(want, abs=1e-7)
    # k=2 covers all of each distribution: product 1, loss 0
    assert joint_topk_loss(_plan(p1, 2), _plan(p2, 2)).item() == pytest.approx(0.0, abs=1e-7)
    # masking the second token leaves the first
    m = torch.tensor([True, False])
    got = joint_topk_loss(_plan(p1, 1), _plan(p2, 1), m).item()
    assert got == pytest.approx(1 - 0.8 * 0.7, abs=1e-7)
    # the product couples the layers: d/dm_a = −m_b / T (not separable like the log form)
    pa = p1.clone().requires_grad_(True)
    joint_topk_loss(_plan(pa, 1), _plan(p2, 1)).backward()
    assert pa.grad[0, 0].item() == pytest.approx(-0.7 / 2, abs=1e-7)
    assert pa.grad[1, 1].item() == pytest.approx(-0.6 / 2, abs=1e-7)


def _toy_model(**losses):
    torch.manual_seed(3)
    cfg = ModelConfig.tiny(n_layers=2)
    cfg.moe.losses = LossConfig(load_balance="none", z_loss_coeff=0.0, **losses)
    return MoETransformer(cfg)


@pytest.mark.parametrize(
    "losses, name",
    [
        (dict(specialization=True, specialization_coeff=1.0), "specialization"),
        (dict(cross_layer=True, cross_layer_coeff=1.0), "cross_layer"),
    ],
)
def test_each_loss_decreases_under_optimisation(losses, name):
    model = _toy_model(**losses)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    first = None
    for _ in range(15):
        value = model(ids).aux_losses[name]
        first = value.item() if first is None else first
        opt.zero_grad()
        value.backward()
        opt.step()
    assert model(ids).aux_losses[name].item() < 0.8 * first


def test_specialization_refuses_gelu_experts():
    with pytest.raises(ValueError, match="SwiGLU"):
        MoEConfig(
            experts=ExpertsConfig(hidden_size=8, ffn_hidden_size=6, activation="gelu"),
            losses=LossConfig(specialization=True),
        )
