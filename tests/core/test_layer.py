import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelab.core import checks
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.dispatch import segment_combine
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.layer import MoELayer

from .reference import plan_routes, ref_layer


def make_layer(E=4, k=2, D=8, F=16, shared=0, gate=False, activation="swiglu", std=0.5, **router):
    cfg = MoEConfig(
        router=RouterConfig(num_experts=E, top_k=k, **router),
        experts=ExpertsConfig(
            hidden_size=D,
            ffn_hidden_size=F,
            activation=activation,
            shared_expert_size=shared,
            shared_expert_gate=gate,
            init_std=std,
        ),
    )
    return MoELayer(cfg)


@settings(max_examples=40, deadline=None)
@given(
    E=st.integers(1, 6),
    kf=st.floats(0, 1),
    T=st.integers(0, 10),
    activation=st.sampled_from(["swiglu", "gelu"]),
    shared=st.sampled_from([0, 5]),
    gate=st.booleans(),
    kind=st.sampled_from(["token_choice", "expert_choice"]),
    cf=st.sampled_from([None, 0.5, 1.0]),
    seed=st.integers(0, 9999),
)
def test_layer_matches_per_token_reference(E, kf, T, activation, shared, gate, kind, cf, seed):
    k = 1 + int(kf * (E - 1))
    torch.manual_seed(seed)
    layer = make_layer(
        E,
        k,
        activation=activation,
        shared=shared,
        gate=gate and shared > 0,
        kind=kind,
        capacity_factor=cf,
    )
    x = torch.randn(T, 8)
    out = layer(x)
    want = ref_layer(layer, x, plan_routes(out.plan))
    torch.testing.assert_close(out.hidden_states.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_grouped_mm_backends_match_reference_forward_and_backward(backend):
    torch.manual_seed(0)
    if backend == "torch" and not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("torch.nn.functional.grouped_mm needs PyTorch >= 2.9")
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(4, 8, 12, requires_grad=True)
    y = grouped_mm(x, w, counts, backend)
    rows = torch.repeat_interleave(torch.arange(4), counts)
    want = torch.einsum("ni,nio->no", x, w[rows])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    wx, ww = torch.autograd.grad(want, (x, w), g)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-5)
    if backend == "loop":
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, counts, "loop"), (x64, w64))


def test_layer_gradcheck_float64():
    torch.manual_seed(0)
    layer = make_layer(E=4, k=2, D=5, F=6, shared=3, gate=True).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)

    def f(x, *params):
        out = torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,))
        return out.hidden_states, sum(out.aux_losses.values())

    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in layer.named_parameters())
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5)


def test_input_is_never_modified_and_output_dtype_follows_input():
    layer = make_layer(shared=4, gate=True)
    for dtype in (torch.float32, torch.bfloat16):
        layer = layer.to(dtype)
        x = torch.randn(3, 4, 8, dtype=dtype)
        before = x.clone()
        out = layer(x)
        assert torch.equal(x, before)
        assert out.hidden_states.dtype == dtype and out.hidden_states.shape == x.shape
        assert out.plan.weight.dtype == torch.float32


def test_edge_shapes_empty_batch_single_expert_k_equals_e_idle_experts():
    assert make_layer()(torch.randn(0, 8)).hidden_states.shape == (0, 8)
    assert make_layer()(torch.randn(2, 0, 8)).record.counts.tolist() == [0, 0, 0, 0]
    one = make_layer(E=1, k=1)
    x = torch.randn(5, 8)
    out = one(x)
    torch.testing.assert_close(
        out.hidden_states.double(), ref_layer(one, x, [[(0, 1.0)]] * 5), rtol=1e-5, atol=1e-5
    )
    full = make_layer(E=4, k=4)
    assert full(x).record.counts.tolist() == [5, 5, 5, 5]
    idle = make_layer(E=6, k=1)
    idle.router.weight.data.zero_()
    idle.router.weight.data[2, 0] = 10.0
    x = torch.randn(7, 8).abs()
    out = idle(x)
    assert out.record.counts.tolist() == [0, 0, 7, 0, 0, 0]
    out.hidden_states.sum().backward()
    assert idle.experts.w_down.grad[0].abs().sum() == 0
    assert idle.experts.w_down.grad[2].abs().sum() > 0


def test_bad_inputs_raise_clear_errors():
    layer = make_layer()
    with pytest.raises(ValueError, match="x: expected shape"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="mask"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match="x"):
        layer(torch.ones(2, 8, dtype=torch.long))
    layer(torch.full((2, 8), float("nan")))  # value checks are off by default (no sync)
    with checks.enabled(), pytest.raises(ValueError, match="NaN"):
        layer(torch.full((2, 8), float("nan")))


def test_padding_excluded_from_record_and_losses():
    torch.manual_seed(0)
    layer = make_layer()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    out = layer(x, mask)
    assert out.record.counts.sum().item() == 7 * 2
    ref = layer(x[mask])  # the same real tokens without padding
    torch.testing.assert_close(out.aux_losses["load_balance"], ref.aux_losses["load_balance"])
    torch.testing.assert_close(out.aux_losses["z_loss"], ref.aux_losses["z_loss"])
    torch.testing.assert_close(out.hidden_states[mask], ref.hidden_states)


def test_segment_combine_equals_index_add():
    torch.manual_seed(0)
    y = torch.randn(10, 3)
    idx = torch.tensor([4, 0, 4, 2, 0, 4, 1, 2, 0, 4])
    want = torch.zeros(6, 3).index_add(0, idx, y)
    torch.testing.assert_close(segment_combine(y, idx, 6), want)


def test_deterministic_repeated_forward_is_bitwise_equal():
    torch.manual_seed(0)
    layer = make_layer(E=8, k=3, D=16, F=32)
    x = torch.randn(64, 16)
    a, b = layer(x).hidden_states, layer(x).hidden_states
    assert torch.equal(a, b)


def test_aux_loss_coefficients_and_switch_off():
    layer = make_layer()
    layer.config.losses = LossConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0)
    assert make_layer().config.losses.aux_loss_coeff == 0.01
    out = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=4),
            experts=ExpertsConfig(8, 16),
            losses=LossConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0),
        )
    )(torch.randn(3, 8))
    assert out.aux_losses == {}


def test_aux_losses_only_when_gradients_are_recorded():
    layer = make_layer()
    x = torch.randn(6, 8)
    assert set(layer(x).aux_losses) == {"load_balance", "z_loss"}
    with torch.no_grad():
        out = layer(x)
    assert out.aux_losses == {}
    assert out.record.counts.sum().item() == 12
