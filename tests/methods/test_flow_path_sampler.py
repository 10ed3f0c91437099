"""The CondOT path, its target velocity, the Euler/CFG sampler and its evaluation count."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.flow.path import ot_path, slide_scaled_noise
from moelab.methods.flow.sampler import cfg_velocity, euler_sample, odeint_sample


def test_path_endpoints_midpoints_and_target_velocity():
    x0 = torch.tensor([[[1.0, -2.0]], [[0.0, 4.0]]])
    x1 = torch.tensor([[[3.0, 2.0]], [[-4.0, 0.0]]])
    x_t, u = ot_path(x0, x1, torch.tensor([0.0, 1.0]))
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[1], x1[1])
    assert torch.equal(u, torch.tensor([[[2.0, 4.0]], [[-4.0, -4.0]]]))
    x_t, _ = ot_path(x0, x1, torch.tensor([0.25, 0.5]))
    # 0.75·(1, −2) + 0.25·(3, 2) = (1.5, −1); 0.5·(0, 4) + 0.5·(−4, 0) = (−2, 2)
    assert torch.equal(x_t, torch.tensor([[[1.5, -1.0]], [[-2.0, 2.0]]]))


def test_slide_noise_is_scaled_by_each_slides_std():
    z1 = torch.stack([torch.arange(6.0).reshape(3, 2), 10 * torch.arange(6.0).reshape(3, 2)])
    noise = slide_scaled_noise(z1, torch.Generator().manual_seed(3))
    plain = torch.randn(z1.shape, generator=torch.Generator().manual_seed(3))
    std0 = torch.arange(6.0).std()  # unbiased: sqrt(17.5 / 5) = 1.8708
    assert math.isclose(float(std0), math.sqrt(3.5), rel_tol=1e-6)
    torch.testing.assert_close(noise[0], plain[0] * std0)
    torch.testing.assert_close(noise[1], plain[1] * 10 * std0)


def _gaussian_velocity(mu: float, s: float):
    """The exact marginal velocity of the independent coupling N(0, 1) → N(mu, s²):
    x_t ~ N(t·mu, σ_t²) with σ_t² = (1−t)² + t²s², and E[x1 − x0 | x_t = x] is
    mu + (t·s² − (1 − t)) / σ_t² · (x − t·mu)."""

    def v(x, t, conditional):
        var = (1 - t) ** 2 + t**2 * s**2
        return mu + (t * s**2 - (1 - t)) / var * (x - t * mu)

    return v


def test_euler_with_the_exact_velocity_lands_on_the_target_gaussian():
    mu, s = 3.0, 0.5
    x0 = torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = euler_sample(_gaussian_velocity(mu, s), x0, steps=400)
    # the exact flow map is x1 = mu + s·x0; Euler's error is O(1/n)
    assert out.nfe == 400
    assert (out.x - (mu + s * x0)).abs().max() < 2e-2
    assert abs(out.x.mean().item() - mu) < 1e-2
    assert abs(out.x.var().item() - s**2) < 1e-2


def test_one_euler_step_from_t0():
    v = _gaussian_velocity(2.0, 1.0)  # at t = 0: v = 2 + (0 − 1)/1 · x = 2 − x
    out = euler_sample(v, torch.tensor([0.5, -1.0]), steps=1)
    assert torch.equal(out.x, torch.tensor([0.5 + 1.5, -1.0 + 3.0]))


def test_cfg_with_w_1_is_the_conditional_velocity_and_costs_one_evaluation_per_step():
    v_c, v_u = torch.tensor([1.0, -2.5, 0.3]), torch.tensor([-4.0, 7.0, 0.3])
    torch.testing.assert_close(cfg_velocity(v_c, v_u, 1.0), v_c)
    torch.testing.assert_close(cfg_velocity(v_c, v_u, 2.0), torch.tensor([6.0, -12.0, 0.3]))
    torch.testing.assert_close(cfg_velocity(v_c, v_u, 0.0), v_u)

    calls = []

    def v(x, t, conditional):
        calls.append(conditional)
        return torch.full_like(x, 1.0 if conditional else -1.0)

    one = euler_sample(v, torch.zeros(2), steps=4, guidance=1.0)
    assert one.nfe == 4 and calls == [True] * 4
    torch.testing.assert_close(one.x, torch.ones(2))  # 4 steps of 1/4 at velocity 1
    calls.clear()
    guided = euler_sample(v, torch.zeros(2), steps=4, guidance=3.0)
    assert guided.nfe == 8 and calls == [True, False] * 4
    torch.testing.assert_close(guided.x, torch.full((2,), 5.0))  # −1 + 3·(1 − (−1)) = 5


def test_bad_steps_or_guidance_are_refused():
    v = _gaussian_velocity(0.0, 1.0)
    with pytest.raises(InvalidValueError, match="steps"):
        euler_sample(v, torch.zeros(1), steps=0)
    with pytest.raises(InvalidValueError, match="guidance"):
        euler_sample(v, torch.zeros(1), steps=1, guidance=-1.0)


def test_odeint_dopri5_matches_the_exact_flow_map():
    pytest.importorskip("torchdiffeq")
    mu, s = -1.0, 2.0
    x0 = torch.linspace(-3, 3, 7, dtype=torch.float64)
    out = odeint_sample(_gaussian_velocity(mu, s), x0)
    torch.testing.assert_close(out.x, mu + s * x0, rtol=1e-4, atol=1e-4)
    assert out.nfe > 6  # adaptive: at least one dopri5 step of 6 stages
