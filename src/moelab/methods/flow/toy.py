"""The 8-Gaussian mechanism check (``task="toy"``): MoE vs dense velocity, sharp modes or not.

As the authors' ``LatentFlow_CFG_toy`` (no VAE; noise ``N(0, I)``; flow loss, balance loss and
the one-step reconstruction ``MSE(x_t + (1 − t)·v, x1)``; CFG dropout of the condition), each
point its own one-cell "slide". The condition is the quadrant of the point's mode
(:mod:`moelab.data.gaussians`). Evaluation samples ``toy_samples`` points from conditions
drawn like the data, with ``euler_steps`` ∈ ``toy_eval_steps`` and CFG scale ``guidance``.
"""

from __future__ import annotations

import torch

from moelab.data.gaussians import eight_gaussian_modes, sample_eight_gaussians
from moelab.methods.flow.config import FlowConfig
from moelab.methods.flow.expression import build_field
from moelab.methods.flow.loop import train_flow_steps
from moelab.methods.flow.metrics import mode_precision, nearest_mode_distance
from moelab.methods.flow.model import LatentFlow

TOY_STD = 0.1  # std of each Gaussian; "within 3σ of a mode" is the precision radius


def train_toy(config: FlowConfig, seed: int) -> LatentFlow:
    """Train ``config.velocity`` (moe or dense) on the toy for ``flow_steps`` steps."""
    gen = torch.Generator().manual_seed(seed * 16 + 5)
    torch.manual_seed(seed * 16 + 6)
    field = build_field(config, LatentFlow.in_size(2, 2, 0), 2)
    model = LatentFlow(
        field,
        latent_size=2,
        view_size=2,
        num_tissues=0,
        cfg_dropout=config.cfg_dropout,
        scale_noise=False,
        gene_loss_weight=config.gene_loss_weight,
    )

    def loss(_: int) -> torch.Tensor:
        points, _, cond = sample_eight_gaussians(config.toy_batch, gen, std=TOY_STD)
        return model.loss(points[:, None], cond[:, None], None, gen)[0]

    train_flow_steps(model, loss, config)
    return model


def evaluate_toy(model: LatentFlow, config: FlowConfig, seed: int) -> dict[str, float]:
    """``precision_<n>`` (share within 3σ of a mode) and ``distance_<n>`` (mean distance to
    the nearest mode) for every ``n`` in ``toy_eval_steps``."""
    modes = eight_gaussian_modes()
    _, _, cond = sample_eight_gaussians(
        config.toy_samples, torch.Generator().manual_seed(seed * 16 + 7), std=TOY_STD
    )
    out = {}
    for n in config.toy_eval_steps:
        sample, _ = model.sample(
            cond[:, None],
            None,
            steps=n,
            guidance=config.guidance,
            generator=torch.Generator().manual_seed(seed * 16 + 8),
        )
        x = sample.x[:, 0]
        out[f"precision_{n}"] = mode_precision(x, modes, 3 * TOY_STD)
        out[f"distance_{n}"] = float(nearest_mode_distance(x, modes).mean())
    return out
