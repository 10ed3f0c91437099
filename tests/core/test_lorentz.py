"""Lorentz-model maths of the hyperbolic experts: points stay on their manifold, maps invert,
the clamp, the curvature projection, midpoints, flatten, the MLR and the layers (float64)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("geoopt")

from moelab.core.experts.hyperbolic import HypLinear, LorentzExpert, LorentzMLR
from moelab.core.experts.lorentz import (
    EXP_MAX_NORM,
    add_time,
    centroid_pool,
    expmap0,
    geoopt_lorentz,
    harmonic_mean_k,
    lorentz_elu,
    lorentz_flatten,
    midpoint,
    minkowski_inner,
    project_curvature,
)
from moelab.errors import InvalidValueError

D64 = torch.float64


def _on(x, k):
    """Max |⟨x, x⟩_L + k| and whether every time coordinate is positive."""
    return (minkowski_inner(x, x) + k).abs().max().item(), bool((x[..., 0] > 0).all())


def _dist0(x, k):
    """Geodesic distance to the origin: √k · arcosh(x_0 / √k)."""
    return math.sqrt(k) * torch.acosh(x[..., 0] / math.sqrt(k))


@pytest.fixture
def points():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 8, 4, generator=g, dtype=D64)  # space parts


@pytest.mark.parametrize("kv", [0.3, 1.0, 2.5])
def test_every_op_keeps_points_on_the_manifold(points, kv):
    k = torch.tensor(kv, dtype=D64)
    x = add_time(points, k)
    for y in (
        x,
        lorentz_elu(x, k),
        midpoint(x, k),
        midpoint(x, k, torch.rand(5, 3, 8, dtype=D64)),
        centroid_pool(x, k, 4),
        lorentz_flatten(x, k),
    ):
        err, positive = _on(y, kv)
        assert err < 1e-10 and positive


def test_exp_and_log_maps_invert_below_the_clamp():
    m = geoopt_lorentz(0.5, learnable=False)
    g = torch.Generator().manual_seed(1)
    v = torch.cat([torch.zeros(6, 1, dtype=D64), torch.randn(6, 5, generator=g, dtype=D64)], -1)
    x = expmap0(v, m)
    assert _on(x, 0.5)[0] < 1e-10
    torch.testing.assert_close(m.logmap0(x), v, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(_dist0(x, 0.5), v[:, 1:].norm(dim=-1), atol=1e-9, rtol=1e-9)


def test_the_exp_map_clamps_the_radius_at_ten():
    m = geoopt_lorentz(1.0, learnable=False)
    v = torch.tensor([[0.0, 9.0, 12.0], [0.0, 3.0, 4.0]], dtype=D64)  # norms 15 and 5
    x = expmap0(v, m)
    assert EXP_MAX_NORM == 10.0
    torch.testing.assert_close(_dist0(x, 1.0), torch.tensor([10.0, 5.0], dtype=D64))
    # the direction is kept: the space part is parallel to v's
    torch.testing.assert_close(x[0, 1:] / x[0, 1:].norm(), torch.tensor([0.6, 0.8], dtype=D64))
    unclamped = expmap0(v, m, max_radius=None)
    assert _dist0(unclamped, 1.0)[0].item() == pytest.approx(15.0, rel=1e-9)


def test_curvature_projection_scales_distances_and_is_the_identity_for_equal_k(points):
    src, dst = geoopt_lorentz(0.5, learnable=True), geoopt_lorentz(2.0, learnable=False)
    x = add_time(points[0] * 0.5, src.k.detach())
    assert project_curvature(x, src, geoopt_lorentz(0.5, learnable=False)) is x
    y = project_curvature(x, src, dst)
    assert _on(y, 2.0)[0] < 1e-10
    # d_dst = d_src · √(k_dst / k_src) = 2 d_src
    torch.testing.assert_close(_dist0(y, 2.0), 2 * _dist0(x, 0.5), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(project_curvature(y, dst, src), x, atol=1e-9, rtol=1e-9)
    y.sum().backward()  # the projection sends gradient to the source k
    assert src.k.grad is not None and src.k.grad.abs().item() > 0


def test_midpoint_hand_cases():
    k = torch.tensor(1.0, dtype=D64)
    a = 0.7
    p = torch.tensor([[math.cosh(a), math.sinh(a), 0.0], [math.cosh(a), -math.sinh(a), 0.0]])
    p = p.to(D64)
    torch.testing.assert_close(midpoint(p, k), torch.tensor([1.0, 0.0, 0.0], dtype=D64))
    torch.testing.assert_close(midpoint(p, k, torch.tensor([[3.0, 0.0]], dtype=D64))[0], p[0])
    same = p[:1].expand(4, 3)
    torch.testing.assert_close(midpoint(same, k), p[0])
    # on k = 4 the equal-weight midpoint of the mirrored pair is the origin (2, 0, 0)
    k4 = torch.tensor(4.0, dtype=D64)
    torch.testing.assert_close(midpoint(2 * p, k4), torch.tensor([2.0, 0.0, 0.0], dtype=D64))


def test_flatten_and_pool_hand_cases():
    k = torch.tensor(1.0, dtype=D64)
    origin = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]], dtype=D64)
    # time √(1 + 1 − (2 − 1)·1) = 1, space (0, 0, 0, 0): the 4-d origin
    torch.testing.assert_close(
        lorentz_flatten(origin, k), torch.tensor([[1.0, 0, 0, 0, 0]], dtype=D64)
    )
    x = add_time(torch.tensor([[[3.0], [4.0], [0.0]]], dtype=D64), k)
    assert lorentz_flatten(x, k)[0, 0].item() == pytest.approx(math.sqrt(10 + 17 + 1 - 2))
    assert centroid_pool(x, k, 2).shape == (1, 1, 2)  # the ragged third step is dropped
    with pytest.raises(InvalidValueError, match="window: must be in"):
        centroid_pool(x, k, 4)


def test_harmonic_mean_k_is_detached():
    a = torch.tensor(0.5, dtype=D64, requires_grad=True)
    b = torch.tensor(1.0, dtype=D64, requires_grad=True)
    k_f = harmonic_mean_k([a, b])
    assert k_f.item() == pytest.approx(2 / 3) and not k_f.requires_grad


def test_lorentz_mlr_with_zero_offsets_is_the_signed_scaled_distance():
    mlr = LorentzMLR(3, 2).double()
    with torch.no_grad():
        mlr.a.zero_()
        mlr.z.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    k = torch.tensor(0.5, dtype=D64)
    x = add_time(torch.tensor([[0.3, -0.4, 1.0]], dtype=D64), k)
    # a = 0: β = ‖z‖, α = ⟨x_s, z⟩, logit = sign(α) ‖z‖ √k |asinh(α / (√k ‖z‖))|
    r = math.sqrt(0.5)
    want = [r * math.asinh(0.3 / r), -2 * r * math.asinh(0.8 / (2 * r))]
    torch.testing.assert_close(mlr(x, k)[0], torch.tensor(want, dtype=D64))


def test_hyplinear_acts_on_the_time_coordinate_too():
    lin = HypLinear(2, 3).double()
    k = torch.tensor(0.5, dtype=D64)
    x = add_time(torch.tensor([[0.2, 0.1]], dtype=D64), k)
    y = lin(x, k)
    assert _on(y, 0.5)[0] < 1e-12
    shifted = x.clone()
    shifted[0, 0] += 1.0
    assert not torch.allclose(lin(shifted, k), y)


def test_gradient_reaches_k_through_the_expert_stack():
    torch.manual_seed(0)
    enc = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(12, 32), torch.nn.Unflatten(1, (8, 4))
    )
    expert = LorentzExpert(enc, k=0.5, learnable=True, pool=2).double()
    y = expert(torch.randn(3, 2, 6, dtype=D64))
    assert y.shape == (3, 1 + 4 * 4) and _on(y, 0.5)[0] < 1e-10
    y.pow(2).sum().backward()  # projx's time, the ELU's, the pool and the flatten use k
    assert expert.k.grad is not None and torch.isfinite(expert.k.grad) and expert.k.grad != 0
    fixed = LorentzExpert(enc, k=0.5, learnable=False, pool=2).double()
    assert not fixed.k.requires_grad


def test_bad_curvature_is_refused():
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidValueError, match="k: the Lorentz parameter"):
            geoopt_lorentz(bad, learnable=True)
    assert geoopt_lorentz(0.5, learnable=True).k.dtype == D64
