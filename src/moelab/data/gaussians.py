"""The 8-Gaussian toy (synthetic): MoLF's own mechanism demo for sharper modes.

Eight isotropic Gaussians (std ``std``) centred on a circle of radius ``radius`` at angles
``(k + ½)·45°``, so every quadrant holds exactly two modes. The condition is coarse: the
quadrant's signs ``(sign x, sign y)`` of the mode a point was drawn from, so the conditional
distribution is bimodal and a velocity field that averages its two modes puts mass between
them (the "averaging artifacts" of MoLF's project page).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def eight_gaussian_modes(radius: float = 2.0) -> Tensor:
    """``[8, 2]`` float32 mode centres ``radius·(cos θ_k, sin θ_k)``, ``θ_k = (k + ½)·π/4``."""
    angles = (torch.arange(8, dtype=torch.float64) + 0.5) * (math.pi / 4)
    return (radius * torch.stack([angles.cos(), angles.sin()], dim=1)).float()


def sample_eight_gaussians(
    n: int, generator: torch.Generator, *, radius: float = 2.0, std: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` points of the toy.

    Returns:
        ``(points [n, 2], mode [n] int64, condition [n, 2])``, float32; the condition is the
        quadrant's signs (±1) of each point's mode.

    Raises:
        InvalidValueError: ``n < 1`` or ``std <= 0``.
    """
    if n < 1 or std <= 0:
        raise InvalidValueError(f"n and std must be positive, got n={n}, std={std}")
    modes = eight_gaussian_modes(radius)
    mode = torch.randint(0, 8, (n,), generator=generator)
    centres = modes[mode]
    points = centres + std * torch.randn(n, 2, generator=generator)
    return points, mode, torch.sign(centres)
