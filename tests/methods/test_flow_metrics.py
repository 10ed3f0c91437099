"""MoLF's metrics, the VAE's KL and the loop's learning-rate schedule, on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import torch

from moelab.data.gaussians import eight_gaussian_modes, sample_eight_gaussians
from moelab.methods.flow.loop import linear_warmup_decay
from moelab.methods.flow.metrics import (
    majority_share,
    mode_precision,
    nearest_mode_distance,
    per_gene_pearson,
    routing_purity,
    slide_pearson,
)
from moelab.methods.flow.vae import kl_to_standard_normal


def test_per_gene_pearson_hand_values_and_constant_genes():
    true = np.array([[1.0, 0.0, 5.0], [2.0, 1.0, 5.0], [3.0, 0.0, 5.0]])
    pred = np.array([[2.0, 3.0, 1.0], [4.0, 1.0, 2.0], [6.0, 2.0, 3.0]])
    r = per_gene_pearson(pred, true)
    assert r[0] == 1.0  # pred = 2·true
    # gene 1: true (0, 1, 0) centred (−1/3, 2/3, −1/3); pred (3, 1, 2) centred (1, −1, 0)
    # r = (−1/3 − 2/3) / sqrt((2/3)·2) = −1 / sqrt(4/3) = −0.8660
    assert math.isclose(r[1], -math.sqrt(3) / 2, rel_tol=1e-12)
    assert np.isnan(r[2])  # constant in truth
    assert math.isclose(slide_pearson(pred, true), (1 - math.sqrt(3) / 2) / 2, rel_tol=1e-12)
    assert slide_pearson(np.ones((3, 2)), true[:, :2]) == 0.0  # no gene defined


def test_routing_purity_and_chance():
    experts = np.array([0, 0, 0, 1, 1, 2])
    labels = np.array([0, 0, 1, 1, 1, 0])
    # expert 0: majority label 0 (2 of 3); expert 1: 2 of 2; expert 2: 1 of 1 → 5/6
    assert math.isclose(routing_purity(experts, labels), 5 / 6)
    assert routing_purity(np.zeros(6, dtype=int), labels) == majority_share(labels) == 0.5


def test_toy_modes_quadrants_and_precision():
    modes = eight_gaussian_modes()
    assert torch.allclose(modes.norm(dim=1), torch.full((8,), 2.0))
    signs = torch.sign(modes)
    assert all((signs == q).all(dim=1).sum() == 2 for q in signs.unique(dim=0))  # 2 per quadrant
    points, mode, cond = sample_eight_gaussians(4000, torch.Generator().manual_seed(0))
    assert torch.equal(cond, torch.sign(modes[mode]))
    # a Gaussian with σ = 0.1 puts 1 − e^{−9/2} = 98.9 % of its mass within 3σ (2-D Rayleigh)
    assert abs(mode_precision(points, modes, 0.3) - (1 - math.exp(-4.5))) < 0.01
    midpoint = (modes[0] + modes[1]) / 2  # the dense field's "averaging artifact"
    assert mode_precision(midpoint[None], modes, 0.3) == 0.0
    d = nearest_mode_distance(midpoint[None], modes).item()
    assert math.isclose(d, 2 * math.sin(math.pi / 8), rel_tol=1e-6)


def test_kl_to_standard_normal_hand_value():
    mean = torch.tensor([[1.0, 0.0]])
    logvar = torch.tensor([[0.0, math.log(4.0)]])
    # ½ Σ (σ² + μ² − 1 − log σ²) = ½ (1 + 1 − 1 − 0) + ½ (4 + 0 − 1 − log 4)
    expected = 0.5 + 0.5 * (3 - math.log(4.0))
    assert math.isclose(kl_to_standard_normal(mean, logvar).item(), expected, rel_tol=1e-6)


def test_linear_warmup_then_linear_decay():
    factors = [linear_warmup_decay(s, steps=10, warmup=2) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[2:] == [(10 - s) / 8 for s in range(2, 10)]
