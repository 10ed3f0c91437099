"""ResidualMLPExpertBank: each expert equals MoLF's TransformerExpert maths (torch's own post-LN
TransformerEncoderLayer on a length-1 sequence), inside MoELayer it is Σ w_e expert_e(x), and it
can be cut like a plain bank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.experts.residual import ResidualMLPExpertBank, residual_expert_parameters
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError

D, H, FF, E = 6, 8, 12, 3


def _bank(seed: int = 0, dropout: float = 0.0) -> ResidualMLPExpertBank:
    torch.manual_seed(seed)
    cfg = ExpertsConfig(
        hidden_size=D, ffn_hidden_size=FF, activation="gelu", bias=True, init_std=0.3
    )
    bank = ResidualMLPExpertBank(cfg, E, model_size=H, dropout=dropout)
    with torch.no_grad():  # non-trivial biases and LayerNorm affines
        for name, p in bank.named_parameters():
            if not name.startswith("w_"):
                p.add_(0.2 * torch.randn_like(p))
    return bank


def _torch_expert(bank: ResidualMLPExpertBank, e: int) -> nn.Module:
    """The authors' TransformerExpert built from torch modules with expert e's weights
    (attention's value projection = W_attn, output projection = identity)."""
    layer = nn.TransformerEncoderLayer(
        H, 2, dim_feedforward=FF, dropout=0.0, activation=F.gelu, batch_first=True
    )
    inp, out = nn.Linear(D, H), nn.Linear(H, D)
    ln_in = nn.LayerNorm(H)
    with torch.no_grad():
        inp.weight.copy_(bank.w_in[e].T)
        inp.bias.copy_(bank.b_in[e])
        ln_in.weight.copy_(bank.ln_in_weight[e])
        ln_in.bias.copy_(bank.ln_in_bias[e])
        attn = layer.self_attn
        attn.in_proj_weight.normal_()  # q and k are irrelevant for one token
        attn.in_proj_weight[2 * H :].copy_(bank.w_attn[e].T)
        attn.in_proj_bias.zero_()
        attn.in_proj_bias[2 * H :].copy_(bank.b_attn[e])
        attn.out_proj.weight.copy_(torch.eye(H))
        attn.out_proj.bias.zero_()
        layer.norm1.weight.copy_(bank.ln_attn_weight[e])
        layer.norm1.bias.copy_(bank.ln_attn_bias[e])
        layer.linear1.weight.copy_(bank.w_1[e].T)
        layer.linear1.bias.copy_(bank.b_1[e])
        layer.linear2.weight.copy_(bank.w_2[e].T)
        layer.linear2.bias.copy_(bank.b_2[e])
        layer.norm2.weight.copy_(bank.ln_ffn_weight[e])
        layer.norm2.bias.copy_(bank.ln_ffn_bias[e])
        out.weight.copy_(bank.w_out[e].T)
        out.bias.copy_(bank.b_out[e])

    def expert(x):
        h = ln_in(inp(x)).unsqueeze(1)
        return out(layer(h).squeeze(1))

    layer.eval()
    return expert


def test_each_expert_is_a_post_ln_transformer_block_on_one_token():
    bank = _bank().eval()
    counts = torch.tensor([2, 3, 1])
    x = torch.randn(6, D)
    y = bank(x, counts)
    start = 0
    for e, c in enumerate(counts.tolist()):
        ref = _torch_expert(bank, e)(x[start : start + c])
        torch.testing.assert_close(y[start : start + c], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bank.expert_output(x[start : start + c], e), ref)
        start += c


def test_activations_are_the_feed_forward_gelu():
    bank = _bank().eval()
    x = torch.randn(4, D)
    y, a = bank(x, torch.tensor([4, 0, 0]), return_activations=True)
    assert a.shape == (4, FF)
    assert torch.equal(y, bank(x, torch.tensor([4, 0, 0])))  # same output either way
    h0 = F.layer_norm(x @ bank.w_in[0] + bank.b_in[0], (H,)) * bank.ln_in_weight[0]
    h0 = h0 + bank.ln_in_bias[0]
    h1 = F.layer_norm(h0 + h0 @ bank.w_attn[0] + bank.b_attn[0], (H,))
    h1 = h1 * bank.ln_attn_weight[0] + bank.ln_attn_bias[0]
    torch.testing.assert_close(a, F.gelu(h1 @ bank.w_1[0] + bank.b_1[0]))


def test_dropout_only_in_training():
    bank = _bank(dropout=0.5)
    x, counts = torch.randn(5, D), torch.tensor([5, 0, 0])
    bank.eval()
    assert torch.equal(bank(x, counts), bank(x, counts))
    bank.train()
    assert not torch.equal(bank(x, counts), bank(x, counts))


def test_in_a_moe_layer_the_output_is_the_weighted_sum_of_experts():
    cfg = MoEConfig(
        router=RouterConfig(num_experts=E, top_k=2, softmax_before_topk=False),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=FF, activation="gelu", bias=True),
        losses=LossConfig(load_balance="none", z_loss_coeff=0.0),
    )
    layer = MoELayer(cfg)
    layer.experts = _bank()
    layer.eval()
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        out = layer(x)
        logits = x.reshape(-1, D) @ layer.router.weight.T
        top, idx = logits.topk(2, dim=-1)
        w = top.softmax(-1)
        ref = torch.zeros(10, D)
        for t in range(10):
            for j in range(2):
                ref[t] += (
                    w[t, j]
                    * layer.experts.expert_output(x.reshape(-1, D)[t : t + 1], int(idx[t, j]))[0]
                )
    torch.testing.assert_close(out.hidden_states.reshape(-1, D), ref, rtol=1e-5, atol=1e-6)


def test_select_experts_keeps_the_chosen_experts_outputs():
    bank = _bank().eval()
    sub = bank.select_experts(torch.tensor([2, 0]))
    x = torch.randn(3, D)
    assert sub.num_experts == 2 and sub.model_size == H
    torch.testing.assert_close(sub.expert_output(x, 0), bank.expert_output(x, 2))
    torch.testing.assert_close(sub.expert_output(x, 1), bank.expert_output(x, 0))


def test_parameter_count_formula():
    bank = _bank()
    assert sum(p.numel() for p in bank.parameters()) == E * residual_expert_parameters(D, H, FF)


def test_bad_settings_are_refused():
    cfg = ExpertsConfig(hidden_size=D, ffn_hidden_size=FF, activation="swiglu")
    with pytest.raises(InvalidValueError, match="activation"):
        ResidualMLPExpertBank(cfg, E, model_size=H)
    gelu = ExpertsConfig(hidden_size=D, ffn_hidden_size=FF, activation="gelu")
    with pytest.raises(InvalidValueError, match="dropout"):
        ResidualMLPExpertBank(gelu, E, model_size=H, dropout=1.0)
    with pytest.raises(InvalidValueError, match="expert"):
        ResidualMLPExpertBank(gelu, E, model_size=H).expert_output(torch.randn(2, D), 3)
