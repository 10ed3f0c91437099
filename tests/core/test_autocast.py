"""The MoE layer under CPU autocast: bf16 experts on every backend, a float32 router and
combine."""

import copy

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.experts import cpu_kernel
from moelab.core.layer import MoELayer

BACKENDS = ["loop", "auto"] if cpu_kernel.kernel() is not None else ["loop"]


def layer(backend, bias=False, lora_rank=0):
    cfg = MoEConfig(
        router=RouterConfig(num_experts=6, top_k=2),
        experts=ExpertsConfig(hidden_size=16, ffn_hidden_size=24, bias=bias, lora_rank=lora_rank),
    )
    torch.manual_seed(0)
    m = MoELayer(cfg)
    m.experts.backend = backend
    for p in m.parameters():  # LoRA's B starts at zero; make every term count
        torch.nn.init.normal_(p, std=0.3)
    return m


def run(m, x, autocast):
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = m(xi)
    out.hidden_states.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return out, xi.grad, grads


def dispatched(m, x_TD, gather=True):
    return m.dispatcher.dispatch(x_TD, m.router(x_TD), gather=gather)


def grads_of(y, *tensors):
    return torch.autograd.grad(y.float().square().sum(), tensors)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("bias", "lora_rank"), [(False, 0), (True, 0), (False, 4)])
def test_the_bank_under_autocast_computes_what_its_bf16_copy_computes(backend, bias, lora_rank):
    """Bit for bit, forward and backward: the float32 weights' gradients are the bf16 copy's
    gradients cast to float32."""
    m = layer(backend, bias, lora_rank)
    x = torch.randn(11, 16)
    d = dispatched(m, x)
    ref = copy.deepcopy(m.experts).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m.experts(d.x, d.counts)
    want = ref(d.x.bfloat16(), d.counts)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    got = grads_of(y, *m.experts.parameters())
    for g, w in zip(got, grads_of(want, *ref.parameters()), strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w.float(), rtol=0, atol=0)


needs_kernel = pytest.mark.skipif(len(BACKENDS) < 2, reason="no C++ toolchain: no fused kernel")


@needs_kernel
def test_the_fused_token_path_under_autocast_computes_what_its_bf16_copy_computes():
    m = layer("auto")
    x = torch.randn(11, 16)
    d = dispatched(m, x, gather=False)
    ref = copy.deepcopy(m.experts).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m.experts.forward_tokens(x, d)
    want = ref.forward_tokens(x.bfloat16(), d)
    assert y.dtype == torch.float32  # the combine sums in float32
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for g, w in zip(
        grads_of(y, *m.experts.parameters()), grads_of(want, *ref.parameters()), strict=True
    ):
        torch.testing.assert_close(g, w.float(), rtol=0, atol=0)


def test_the_combine_sums_in_float32_under_autocast():
    m = layer("loop")
    x = torch.randn(11, 16)
    d = dispatched(m, x)
    y = torch.randn(d.x.shape[0], 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m.dispatcher.combine(y, d, 11)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, m.dispatcher.combine(y, d, 11), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_router_stays_float32_under_autocast(backend):
    m = layer(backend)
    x = torch.randn(3, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = m(x).plan
    want = m.router.logits(x.reshape(-1, 16))
    assert plan.logits.dtype == torch.float32
    torch.testing.assert_close(plan.logits, want, rtol=0, atol=0)


@needs_kernel
def test_the_fused_and_loop_backends_agree_under_autocast():
    x = torch.randn(4, 9, 16)
    a, ga, _ = run(layer("auto"), x, autocast=True)
    b, gb, _ = run(layer("loop"), x, autocast=True)
    torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ga, gb, rtol=2e-2, atol=2e-2)
