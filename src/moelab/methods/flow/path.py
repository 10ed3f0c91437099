"""The conditional optimal-transport (CondOT) probability path and its velocity target.

Flow matching (Lipman et al., "Flow Matching for Generative Modeling", ICLR 2023, arXiv
2210.02747, eq. 20–23 with σ_min = 0; equivalently rectified flow, Liu et al., arXiv
2209.03003): for a noise sample ``x0``, a data sample ``x1`` and a time ``t ∈ [0, 1]``,

    x_t = (1 − t)·x0 + t·x1,        u_t(x_t | x0, x1) = x1 − x0,

and the velocity field is trained by regressing ``v_θ(x_t, t)`` on ``x1 − x0`` (MSE). MoLF
(as the authors' code runs) draws ``t`` per slide and scales the noise of each slide by the
standard deviation of that slide's latents (:func:`slide_scaled_noise`). Written from the
equations; the authors' ``flow_matching`` library (CC BY-NC) is not used.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ot_path(x0: Tensor, x1: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """A point on the CondOT path and its target velocity.

    Args:
        x0, x1: ``[B, ...]`` noise and data, same shape.
        t: ``[B]`` times in [0, 1] (one per leading index, broadcast over the rest).
    Returns:
        ``(x_t, u)``: ``(1 − t)·x0 + t·x1`` and ``x1 − x0``, both ``[B, ...]``.
    """
    tb = t.reshape(-1, *([1] * (x1.dim() - 1))).to(x1.dtype)
    return (1 - tb) * x0 + tb * x1, x1 - x0


def slide_scaled_noise(z1: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``N(0, I)`` noise shaped like ``z1 [B, ...]``, each leading slice scaled by the
    (unbiased) standard deviation of all values of ``z1[b]``, clamped below at 1e-6 (the
    authors' ``LatentFlow.forward``)."""
    std = z1.reshape(z1.shape[0], -1).std(dim=1).clamp_min(1e-6)
    noise = torch.randn(z1.shape, generator=generator, device=z1.device, dtype=z1.dtype)
    return noise * std.reshape(-1, *([1] * (z1.dim() - 1)))
