"""Minimum-cost perfect matching of a square cost matrix (places experts on TileQ's grid
cells): SciPy's ``linear_sum_assignment`` (a shortest-augmenting-path Hungarian method), a
well-kept library outside the MoE core.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from moelab.errors import InvalidValueError


def min_cost_assignment(cost: Tensor) -> Tensor:
    """Column assigned to each row of a square cost matrix, minimising the total cost.

    Args:
        cost: ``[n, n]`` finite real costs.
    Returns:
        ``[n]`` int64 permutation ``p`` minimising ``Σ_i cost[i, p[i]]``.
    Raises:
        ValueError: not square, empty, or not finite.
    """
    if cost.dim() != 2 or cost.shape[0] != cost.shape[1] or cost.shape[0] == 0:
        raise InvalidValueError(
            f"cost: expected a non-empty square matrix, got {tuple(cost.shape)}"
        )
    if not torch.isfinite(cost).all():
        raise InvalidValueError("cost: contains NaN or Inf")
    rows, cols = linear_sum_assignment(cost.detach().double().cpu().numpy())
    out = torch.empty(cost.shape[0], dtype=torch.int64)
    out[torch.from_numpy(rows)] = torch.from_numpy(cols)
    return out
