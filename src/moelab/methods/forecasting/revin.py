"""Reversible instance normalisation (RevIN; Kim et al., "Reversible Instance Normalization
for Accurate Time-Series Forecasting against Distribution Shift", ICLR 2022).

Each window is normalised by its own look-back mean and std, then an affine map
``γ·z + β`` is applied; the forecast is mapped back with the inverse affine map and the same
statistics: ``ŷ = (ŷ_n − β) / γ · σ + μ``. PatchTST uses it; one channel here, so γ, β are
scalars.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RevIN(nn.Module):
    """``normalize(x [B, L]) → (z [B, L], (μ [B, 1], σ [B, 1]))`` and
    ``denormalize(y [B, H], stats) → [B, H]`` in the input's units.

    Args:
        eps: added to the variance (``σ = sqrt(var + eps)``, population variance).
        affine: learn γ (init 1) and β (init 0).
    """

    def __init__(self, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1)) if affine else None
        self.bias = nn.Parameter(torch.zeros(1)) if affine else None

    def normalize(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        mean = x.mean(-1, keepdim=True)
        std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + self.eps)
        z = (x - mean) / std
        if self.weight is not None:
            z = z * self.weight + self.bias
        return z, (mean, std)

    def denormalize(self, y: Tensor, stats: tuple[Tensor, Tensor]) -> Tensor:
        mean, std = stats
        if self.weight is not None:
            # the same guard as the reference code: γ near 0 must not divide by zero
            y = (y - self.bias) / (self.weight + self.eps * self.eps)
        return y * std + mean
