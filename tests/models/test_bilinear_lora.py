"""The bilinear MoE-LoRA layer (MoELoRA's and SAME's ``Σᵢ gᵢ Bᵢ (Σⱼ gⱼ Aⱼ x)``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moelab.analysis.consistency import route_stability
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.bilinear_lora import BilinearMoELoRALinear, weights_record


def _loop(layer: BilinearMoELoRALinear, x, g):
    """Token by token, expert by expert, with plain matrix-vector products."""
    out = []
    for t in range(x.shape[0]):
        a = sum(g[t, j] * (layer.lora_A[j] @ x[t]) for j in range(layer.num_experts))
        out.append(sum(g[t, i] * (layer.lora_B[i] @ a) for i in range(layer.num_experts)))
    return layer.scaling * torch.stack(out)


def _layer(E=3, rank=7, seed=0):
    torch.manual_seed(seed)
    layer = BilinearMoELoRALinear(nn.Linear(5, 4), E, rank, alpha=3.0).double()
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def test_combine_equals_the_per_token_loop():
    layer = _layer()
    assert layer.lora_A.shape == (3, 2, 5) and layer.lora_B.shape == (3, 4, 2)  # ⌊7/3⌋ = 2
    x = torch.randn(6, 5, dtype=torch.float64)
    g = torch.softmax(torch.randn(6, 3, dtype=torch.float64), -1)
    torch.testing.assert_close(layer.combine(x, g), _loop(layer, x, g), atol=1e-12, rtol=0)
    # one weight vector for every token broadcasts
    g1 = g[2]
    torch.testing.assert_close(layer.combine(x, g1), _loop(layer, x, g1.expand(6, 3)))


def test_bilinear_has_cross_terms():
    """Two experts at ½ each: ¼(B₀+B₁)(A₀+A₁)x, not ½(B₀A₀ + B₁A₁)x."""
    layer = _layer(E=2, rank=2)
    x = torch.randn(1, 5, dtype=torch.float64)
    A, B = layer.lora_A, layer.lora_B
    want = 0.25 * ((B[0] + B[1]) @ (A[0] + A[1]) @ x[0]) * layer.scaling
    got = layer.combine(x, torch.tensor([0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(got[0], want)


def test_forward_routes_each_token_with_its_softmax():
    layer = _layer()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    g = torch.softmax(layer.router(x), -1)
    want = layer.base(x) + _loop(layer, x.reshape(6, 5), g.reshape(6, 3)).reshape(2, 3, 4)
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer.last_weights, g.float())
    assert layer.last_record.batch_shape == (2, 3)
    assert torch.equal(layer.last_record.top1, g.reshape(6, 3).argmax(-1))


def test_fresh_layer_is_the_base_layer():
    base = nn.Linear(5, 4)
    layer = BilinearMoELoRALinear(base, 2, 4, 8.0)
    x = torch.randn(3, 5)
    assert torch.equal(layer(x), base(x))
    assert not base.weight.requires_grad
    assert abs(float(layer.lora_A.detach().std()) - 0.01) < 0.004  # N(0, 0.01²) [C]


def test_weights_record_route_stability():
    p = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.5, 0.4]])
    q = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.1, 0.9]])
    assert route_stability(weights_record(p), weights_record(q)).fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("args", "err", "needle"),
    [
        ((nn.Conv1d(2, 2, 1), 2, 4, 1.0), InvalidTypeError, "nn.Linear"),
        ((nn.Linear(2, 2), 0, 4, 1.0), InvalidValueError, "num_experts"),
        ((nn.Linear(2, 2), 3, 2, 1.0), InvalidValueError, "rank: must be >= num_experts=3"),
        ((nn.Linear(2, 2), 2, 4, 0.0), InvalidValueError, "alpha"),
    ],
)
def test_bad_arguments(args, err, needle):
    with pytest.raises(err, match=needle):
        BilinearMoELoRALinear(*args)
