"""MoLF's velocity fields: the MoE with one expert is the dense field, router noise only in
training, the balance loss in transformers' convention, matched active parameters."""

from __future__ import annotations

import warnings

import torch

from moelab.methods.flow.velocity import (
    AttentionVelocity,
    DenseVelocity,
    MoEVelocity,
    matched_ffn_size,
)

D, L, H, FF = 7, 3, 8, 16


def test_moe_with_one_expert_equals_the_dense_field():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # top_k=1 weight is exactly 1 (RouterConfig warns)
        moe = MoEVelocity(D, L, num_experts=1, top_k=1, model_size=H, ffn_size=FF)
    dense = DenseVelocity(D, L, model_size=H, ffn_size=FF)
    dense.block.load_state_dict(moe.moe.experts.state_dict())
    dense.out.load_state_dict(moe.out.state_dict())
    moe.eval()
    dense.eval()
    h = torch.randn(2, 5, D)
    torch.testing.assert_close(moe(h).velocity, dense(h).velocity)
    assert moe(h).velocity.shape == (2, 5, L)


def test_router_logit_noise_is_off_in_eval_and_on_in_training():
    torch.manual_seed(1)
    moe = MoEVelocity(D, L, num_experts=4, top_k=2, model_size=H, ffn_size=FF, logit_noise_std=5.0)
    h = torch.randn(3, 4, D)
    moe.eval()
    with torch.no_grad():
        a, b = moe(h), moe(h)
    assert torch.equal(a.velocity, b.velocity)
    clean = h.reshape(-1, D) @ moe.moe.router.weight.T
    torch.testing.assert_close(a.record.probs, clean.softmax(-1))
    assert torch.equal(
        a.record.all_expert_idx.sort().values, clean.topk(2, -1).indices.reshape(-1).sort().values
    )
    moe.train()
    with torch.no_grad():
        noisy = moe(h).record.probs
    assert (noisy - clean.softmax(-1)).abs().max() > 0.05  # σ = 5 moves the probabilities


def test_balance_loss_is_switch_in_transformers_convention():
    torch.manual_seed(2)
    E, k = 4, 2
    moe = MoEVelocity(
        D,
        L,
        num_experts=E,
        top_k=k,
        model_size=H,
        ffn_size=FF,
        logit_noise_std=0.0,
        aux_loss_coeff=1.0,
    )
    moe.train()
    out = moe(torch.randn(2, 6, D))
    counts = torch.bincount(out.record.all_expert_idx, minlength=E).float()
    f = counts / 12  # fraction of tokens choosing expert i (hf: count / T)
    P = out.record.probs.mean(0)
    torch.testing.assert_close(out.aux_losses["load_balance"], E * (f * P).sum())
    assert set(out.aux_losses) == {"load_balance"}  # no z-loss
    nobal = MoEVelocity(D, L, num_experts=E, top_k=k, model_size=H, ffn_size=FF, aux_loss_coeff=0)
    assert nobal.train()(torch.randn(2, 6, D)).aux_losses == {}


def test_dense_twin_matches_the_active_parameters():
    E, k = 6, 2
    moe = MoEVelocity(D, L, num_experts=E, top_k=k, model_size=H, ffn_size=FF)
    F_d = matched_ffn_size(D, H, FF, E, k)
    dense = DenseVelocity(D, L, model_size=H, ffn_size=F_d)
    per_expert = sum(p.numel() for p in moe.moe.experts.parameters()) // E
    active = (
        k * per_expert
        + moe.moe.router.weight.numel()
        + sum(p.numel() for p in moe.out.parameters())
    )
    dense_params = sum(p.numel() for p in dense.parameters())
    assert abs(dense_params - active) <= H + 1  # one unit of F is 2H + 1 parameters
    assert F_d > k * FF  # the twin also pays for the attention/in/out maps only once


def test_attention_head_mixes_the_cells_of_a_slide_only():
    torch.manual_seed(3)
    head = AttentionVelocity(D, L, model_size=H, heads=2).eval()
    h = torch.randn(2, 5, D)
    base = head(h).velocity
    changed = h.clone()
    changed[0, 4] += 1.0
    out = head(changed).velocity
    assert not torch.allclose(out[0, 0], base[0, 0])  # another cell of slide 0 moves
    torch.testing.assert_close(out[1], base[1])  # slide 1 is untouched
