"""Curvature-aware cross-attention: the masked diagonal, the scores (−d²_L over the curvature
temperature plus the prior), no gradient into the modality curvatures, the contribution and
the routing plan built from the attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("geoopt")

from moelab.core.experts.curvature_attention import (
    CurvatureAwareCrossAttention,
    attention_plan,
    attention_received,
)
from moelab.core.experts.lorentz import add_time, minkowski_inner
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidValueError

D64 = torch.float64


def _inputs(seed=0, B=4, M=3, D=6, k=0.5):
    g = torch.Generator().manual_seed(seed)
    k_f = torch.tensor(k, dtype=D64)
    return add_time(0.5 * torch.randn(B, M, D, generator=g, dtype=D64), k_f), k_f


def test_the_diagonal_is_masked_and_rows_are_distributions():
    torch.manual_seed(0)
    layer = CurvatureAwareCrossAttention(6, 5, num_heads=2).double()
    x, k_f = _inputs()
    y, attn = layer(x, k_f, torch.tensor([0.4, 0.5, 0.7], dtype=D64))
    assert attn.shape == (4, 2, 3, 3) and y.shape == (4, 3, 6)
    assert torch.equal(torch.diagonal(attn, dim1=-2, dim2=-1), torch.zeros(4, 2, 3, dtype=D64))
    torch.testing.assert_close(attn.sum(-1), torch.ones(4, 2, 3, dtype=D64))
    assert (minkowski_inner(y, y) + 0.5).abs().max() < 1e-10


def test_scores_are_negative_squared_distance_over_the_curvature_temperature_plus_prior():
    torch.manual_seed(1)
    layer = CurvatureAwareCrossAttention(6, 5, num_heads=1, prior_init=0.3).double()
    x, k_f = _inputs(1)
    ks = torch.tensor([0.25, 0.5, 1.0], dtype=D64)
    _, attn = layer(x, k_f, ks)
    q, c = layer.q[0](x, k_f), layer.k[0](x, k_f)
    ip = torch.einsum("bid,bjd->bij", q[..., 1:], c[..., 1:]) - q[..., :1] * c[..., :1].transpose(
        1, 2
    )
    neg_d2 = 2 * 0.5 + 2 * ip  # = −d²_L(q_i, c_j)
    mag = 1 / (ks + 1e-6)
    tau0 = layer.tau0.detach()
    assert tau0.item() == pytest.approx(math.sqrt(5), rel=1e-6)  # τ_0 = √D' at init
    tau = tau0 / (mag + 1e-6).sqrt()
    lam = F.softplus(layer.prior_raw).detach()  # 0.3, up to the float32 init of its raw value
    assert lam.item() == pytest.approx(0.3, rel=1e-6)
    scores = neg_d2 / tau.view(3, 1) + lam * torch.log(mag + 1e-6)
    scores = scores.masked_fill(torch.eye(3, dtype=torch.bool), float("-inf"))
    torch.testing.assert_close(attn[:, 0], scores.softmax(-1), atol=1e-10, rtol=1e-10)


def test_the_fusion_sends_no_gradient_to_the_modality_curvatures():
    layer = CurvatureAwareCrossAttention(6, 5, num_heads=2).double()
    x, k_f = _inputs()
    ks = torch.tensor([0.4, 0.5, 0.7], dtype=D64, requires_grad=True)
    y, attn = layer(x, k_f, ks)
    (y.sum() + attn.sum()).backward()
    assert ks.grad is None
    assert layer.prior_raw.grad is not None and layer.tau0.grad is not None


def test_curvature_awareness_depends_on_the_curvatures_and_the_ablation_does_not():
    torch.manual_seed(2)
    aware = CurvatureAwareCrossAttention(6, 5, num_heads=2).double()
    torch.manual_seed(2)
    plain = CurvatureAwareCrossAttention(6, 5, num_heads=2, curvature_aware=False).double()
    x, k_f = _inputs(2)
    k1, k2 = torch.tensor([0.5, 0.5, 0.5], dtype=D64), torch.tensor([0.2, 0.5, 2.0], dtype=D64)
    assert not torch.allclose(aware(x, k_f, k1)[1], aware(x, k_f, k2)[1])
    torch.testing.assert_close(plain(x, k_f, k1)[1], plain(x, k_f, k2)[1])
    assert plain.prior_raw is None


def test_bad_inputs_are_refused():
    layer = CurvatureAwareCrossAttention(6, 5, num_heads=1).double()
    x, k_f = _inputs(M=1)
    with pytest.raises(InvalidValueError, match=">= 2 modalities"):
        layer(x, k_f, torch.tensor([0.5], dtype=D64))
    x, k_f = _inputs()
    with pytest.raises(InvalidValueError, match="ks: must hold one k per modality"):
        layer(x, k_f, torch.tensor([0.5, 0.5], dtype=D64))


def test_attention_received_and_plan_hand_case():
    rows = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    attn = rows.expand(2, 1, 3, 3)  # B = 2, H = 1
    # columns: A gets 2, B 0.5, C 0.5 of the 3 rows
    torch.testing.assert_close(attention_received(attn), torch.tensor([2 / 3, 1 / 6, 1 / 6]))
    plan = attention_plan(attn)
    assert plan.num_tokens == 6 and plan.num_pairs == 12 and plan.num_experts == 3
    # token 0 (sample 0, query A) → B and C with 0.5 each; token 1 (query B) → A 1.0, C 0.0
    assert plan.expert_idx[:4].tolist() == [1, 2, 0, 2]
    torch.testing.assert_close(plan.weight[:4], torch.tensor([0.5, 0.5, 1.0, 0.0]))
    record = RoutingRecord.from_plan(plan, torch.ones(6, dtype=torch.bool), (2, 3), padded=False)
    torch.testing.assert_close(record.mean_probs, torch.tensor([2 / 3, 1 / 6, 1 / 6]))
    assert record.counts.tolist() == [4, 4, 4]


def test_softmax_of_the_plan_logits_gives_its_probs():
    torch.manual_seed(3)
    layer = CurvatureAwareCrossAttention(6, 5, num_heads=2).double()
    x, k_f = _inputs(3)
    _, attn = layer(x, k_f, torch.tensor([0.4, 0.5, 0.7], dtype=D64))
    plan = attention_plan(attn)
    torch.testing.assert_close(F.softmax(plan.logits, -1), plan.probs, atol=1e-6, rtol=1e-6)
