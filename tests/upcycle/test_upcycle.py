"""Upcycling maths on tiny random dense models: output preservation, weights, router init."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import RouterConfig
from moelab.core.layer import MoELayer
from moelab.models import ModelConfig, MoETransformer, SwiGLUFFN, load_model, save_model
from moelab.train.upcycle import (
    max_logit_diff,
    selects_complete_copies,
    upcycle,
    upcycle_ffn_weights,
    upcycle_spec,
)

from .conftest import make_dense

CASES = [(1, 1, 1), (4, 2, 1), (8, 8, 1), (4, 2, 2), (4, 1, 3), (8, 2, 4), (3, 3, 2), (2, 1, 48)]


@pytest.mark.parametrize(("E", "k", "G"), CASES)
def test_upcycled_logits_equal_dense(dense, ids, E, k, G):
    moe = upcycle(dense, E, k, G, seed=3)
    assert moe.cfg.moe.router.num_experts == E * G and moe.cfg.moe.router.top_k == k * G
    assert moe.cfg.moe.experts.ffn_hidden_size == 48 // G
    ref = dense(ids).logits
    got = moe(ids).logits
    assert ref.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    assert selects_complete_copies(moe, ids, G)


@pytest.mark.parametrize(("E", "k", "G"), [(4, 2, 1), (4, 2, 2), (6, 3, 4)])
def test_float64_is_exact_to_rounding(dense, ids, E, k, G):
    d64 = dense.double()
    moe = upcycle(d64, E, k, G, seed=0)
    assert moe.embed.weight.dtype == torch.float64
    assert max_logit_diff(d64, moe, ids) < 1e-12


def test_untied_gqa_and_first_dense_layers(ids):
    dense = make_dense(tie=False, n_kv_heads=1, seed=5)
    moe = upcycle(dense, 4, 2, 2, first_dense_layers=1)
    assert isinstance(moe.blocks[0].ffn, SwiGLUFFN)
    assert all(isinstance(b.ffn, MoELayer) for b in moe.blocks[1:])
    assert moe.lm_head.weight is not moe.embed.weight
    assert max_logit_diff(dense, moe, ids) < 2e-6


def test_tied_embeddings_stay_tied(dense):
    moe = upcycle(dense, 2, 1)
    assert moe.lm_head.weight is moe.embed.weight
    torch.testing.assert_close(moe.embed.weight, dense.embed.weight, rtol=0, atol=0)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_expert_weights_are_dense_ffn_slices(dense, G):
    E = 3
    moe = upcycle(dense, E, 2, G)
    f = 48 // G
    for block, dblock in zip(moe.blocks, dense.blocks, strict=True):
        bank, ffn = block.ffn.experts, dblock.ffn
        for c in range(E):
            for g in range(G):
                j = c * G + g
                rows = slice(g * f, (g + 1) * f)
                assert torch.equal(bank.w_gate_up[j, :, :f], ffn.w_gate.weight[rows].T)
                assert torch.equal(bank.w_gate_up[j, :, f:], ffn.w_up.weight[rows].T)
                assert torch.equal(bank.w_down[j], G * ffn.w_down.weight[:, rows].T)
        # the G slices of any copy rebuild the dense FFN exactly (up to the scale G)
        x = torch.randn(17, 32)
        for c in range(E):
            total = sum(bank.expert_output(x, c * G + g) for g in range(G))
            torch.testing.assert_close(total / G, ffn(x), rtol=1e-5, atol=1e-6)


def test_virtual_group_router_rows(dense):
    E, G = 4, 3
    moe = upcycle(dense, E, 2, G, seed=7)
    for block in moe.blocks:
        w = block.ffn.router.weight.view(E, G, -1)
        assert torch.equal(w, w[:, :1].expand_as(w))  # tied within a copy
        assert torch.cdist(w[:, 0], w[:, 0]).add(torch.eye(E)).min() > 0  # distinct copies
    again = upcycle(dense, E, 2, G, seed=7)
    other = upcycle(dense, E, 2, G, seed=8)
    assert torch.equal(again.blocks[0].ffn.router.weight, moe.blocks[0].ffn.router.weight)
    assert not torch.equal(other.blocks[0].ffn.router.weight, moe.blocks[0].ffn.router.weight)


def test_output_preserved_whatever_the_router_when_g1(dense, ids):
    moe = upcycle(dense, 4, 2, 1)
    with torch.no_grad():
        for block in moe.blocks:
            block.ffn.router.weight.normal_(0, 3.0)
    assert max_logit_diff(dense, moe, ids) < 2e-6


def test_broken_router_is_detected(dense, ids):
    """Independent router rows with G > 1 select incomplete copies and change the output."""
    moe = upcycle(dense, 4, 2, 2)
    with torch.no_grad():
        for block in moe.blocks:
            block.ffn.router.weight.normal_(0, 0.5)
    assert not selects_complete_copies(moe, ids, 2)
    assert max_logit_diff(dense, moe, ids) > 1e-2


@pytest.mark.parametrize(
    "router",
    [
        RouterConfig(softmax_before_topk=False, norm_topk_prob=False),
        RouterConfig(score_func="sigmoid", norm_topk_prob=True),
        RouterConfig(routed_scaling_factor=2.5),
        RouterConfig(expert_bias=True),
    ],
    ids=["softmax_after_topk", "sigmoid_norm", "scaling_factor", "expert_bias"],
)
def test_other_preserving_routers(dense, ids, router):
    moe = upcycle(dense, 4, 2, 2, router=router)
    assert max_logit_diff(dense, moe, ids) < 2e-6


@pytest.mark.parametrize(
    ("router", "match"),
    [
        (RouterConfig(norm_topk_prob=False), "norm_topk_prob"),
        (RouterConfig(score_func="sigmoid", norm_topk_prob=False), "norm_topk_prob"),
        (RouterConfig(capacity_factor=1.0), "capacity_factor"),
        (RouterConfig(kind="expert_choice"), "router.kind"),
        (RouterConfig(num_experts=8, top_k=2, n_group=4, topk_group=2), "n_group"),
    ],
)
def test_non_preserving_routers_raise(dense, router, match):
    with pytest.raises(ValueError, match=match):
        upcycle(dense, 4, 2, 2, router=router)


def test_random_router_init(dense, ids):
    moe = upcycle(dense, 4, 2, 1, router_init="random")
    assert max_logit_diff(dense, moe, ids) < 2e-6
    with pytest.raises(ValueError, match="router_init"):
        upcycle(dense, 4, 2, 2, router_init="random")
    with pytest.raises(ValueError, match="router_init"):
        upcycle(dense, 4, 2, 1, router_init="zeros")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 1), "num_experts"),
        ((4, 5, 1), "top_k"),
        ((4, 0, 1), "top_k"),
        ((4, 2, 0), "granularity"),
        ((4, 2, 5), "granularity"),  # 5 does not divide F = 48
        ((4.0, 2, 1), "num_experts"),
    ],
)
def test_bad_arguments_raise(dense, args, match):
    with pytest.raises(ValueError, match=match):
        upcycle(dense, *args)


def test_bad_models_raise(dense):
    cfg = ModelConfig.tiny()
    with pytest.raises(ValueError, match="dense_model"):
        upcycle(MoETransformer(cfg), 2, 1)
    with pytest.raises(TypeError, match="dense_model"):
        upcycle(torch.nn.Linear(2, 2), 2, 1)
    with pytest.raises(ValueError, match="first_dense_layers"):
        upcycle(dense, 2, 1, first_dense_layers=3)


def test_dense_model_untouched_and_mode_kept(dense, ids):
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    dense.train()
    moe = upcycle(dense, 4, 2, 2)
    assert moe.training
    for k, v in dense.state_dict().items():
        assert torch.equal(v, before[k])


def test_upcycled_model_saves_and_loads(dense, ids, tmp_path):
    moe = upcycle(dense, 4, 2, 2).eval()
    save_model(moe, tmp_path / "m")
    back = load_model(tmp_path / "m").eval()
    assert back.cfg == moe.cfg
    assert max_logit_diff(dense, back, ids) < 2e-6


def test_upcycled_model_trains(dense, ids):
    """One optimizer step moves the copies apart (gradients reach experts and router)."""
    moe = upcycle(dense, 4, 2, 2).train()
    out = moe.loss(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    bank = moe.blocks[0].ffn.experts
    assert bank.w_gate_up.grad is not None and bank.w_gate_up.grad.abs().sum() > 0
    assert moe.blocks[0].ffn.router.weight.grad.abs().sum() > 0


def test_ffn_weights_helper_and_spec():
    ffn = SwiGLUFFN(8, 12)
    gu, down = upcycle_ffn_weights(ffn, copies=2, granularity=3)
    assert gu.shape == (6, 8, 8) and down.shape == (6, 4, 8)
    spec = upcycle_spec(12, 2, 1, 3, RouterConfig(routed_scaling_factor=2.0))
    assert (spec.num_experts, spec.top_k, spec.expert_ffn_size) == (6, 3, 4)
    assert spec.down_scale == pytest.approx(1.5)
