"""Expert activations of issue 9 against references: GPT-OSS's clamped SwiGLU experts with
biases against transformers' ``GptOssExperts``; GELU-tanh and GeGLU against the formula."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.dispatch import LocalDispatcher
from moelab.core.experts import ExpertBank
from moelab.core.layer import MoELayer
from moelab.core.plan import RoutingPlan
from moelab.models import ModelConfig, MoETransformer


def _plan(idx_Tk, w_Tk, E):
    T, k = idx_Tk.shape
    return RoutingPlan(
        token_idx=torch.arange(T).repeat_interleave(k),
        expert_idx=idx_Tk.reshape(-1),
        weight=w_Tk.reshape(-1),
        logits=torch.zeros(T, E),
        probs=torch.full((T, E), 1.0 / E),
        num_experts=E,
        top_k=k,
    )


def _run(bank, x, plan):
    d = LocalDispatcher()
    out = d.dispatch(x, plan)
    return d.combine(bank(out.x, out.counts), out, x.shape[0])


def test_clamped_swiglu_with_biases_matches_transformers_gpt_oss():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    D, F, E, T, k = 8, 6, 4, 11, 2
    hf_cfg = transformers.GptOssConfig(
        hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k
    )
    ref = GptOssExperts(hf_cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 1.5)  # large enough that the clamps at ±7 bite
    bank = ExpertBank(ExpertsConfig(D, F, activation="swiglu_clamped", bias=True), E)
    with torch.no_grad():  # de-interleave GPT-OSS's gate/up columns into gate block | up block
        gu, gub = ref.gate_up_proj, ref.gate_up_proj_bias
        bank.w_gate_up.copy_(torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1))
        bank.b_gate_up.copy_(torch.cat([gub[..., ::2], gub[..., 1::2]], dim=-1))
        bank.w_down.copy_(ref.down_proj)
        bank.b_down.copy_(ref.down_proj_bias)
    x = 2.0 * torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    with torch.no_grad():
        want = ref(x, router_indices=idx, routing_weights=w)
        got = _run(bank, x, _plan(idx, w, E))
        h = x @ bank.w_gate_up[0] + bank.b_gate_up[0]
    assert (h[:, :F] > 7).any() and (h[:, F:].abs() > 7).any()  # the clamps were exercised
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("activation", ["gelu_tanh", "geglu"])
def test_gelu_tanh_experts_follow_the_formula(activation):
    torch.manual_seed(0)
    D, F, E = 5, 7, 3
    bank = ExpertBank(ExpertsConfig(D, F, activation=activation, init_std=0.7), E)
    x = torch.randn(4, D, dtype=torch.float64)
    bank = bank.double()
    for e in range(E):
        h = x @ bank.w_in[e]
        a = _gelu_tanh(h[:, :F]) * h[:, F:] if activation == "geglu" else _gelu_tanh(h)
        assert torch.allclose(bank.expert_output(x, e), a @ bank.w_down[e], atol=1e-12)
    assert bank.w_in.shape == (E, D, 2 * F if activation == "geglu" else F)


def test_expert_biases_start_at_zero_in_a_model_and_train():
    cfg = ModelConfig.tiny(vocab_size=30, n_layers=1)
    cfg.moe.experts.bias = True
    cfg.moe.experts.activation = "swiglu_clamped"
    model = MoETransformer(cfg)
    bank = model.blocks[0].ffn.experts
    assert bank.b_gate_up.abs().sum() == 0 and bank.b_down.abs().sum() == 0
    ids = torch.randint(0, 30, (2, 6))
    model.loss(ids, ids).loss.backward()
    assert bank.b_down.grad.abs().sum() > 0


def test_layer_with_biased_experts_matches_per_token_loop():
    torch.manual_seed(0)
    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2),
            experts=ExpertsConfig(6, 5, activation="geglu", bias=True, init_std=0.5),
        )
    )
    with torch.no_grad():
        layer.experts.b_gate_up.normal_()
        layer.experts.b_down.normal_()
    x = torch.randn(7, 6)
    out = layer(x)
    want = torch.zeros(7, 6)
    for t, e, w in zip(out.plan.token_idx, out.plan.expert_idx, out.plan.weight, strict=True):
        want[t] += w * layer.experts.expert_output(x[t : t + 1], int(e))[0]
    assert torch.allclose(out.hidden_states, want, atol=1e-5)
