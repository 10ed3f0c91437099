"""Minimum-cost perfect matching (the Hungarian method with potentials, O(n³)).

Kuhn (1955) / Munkres (1957), in the shortest-augmenting-path form with dual potentials
(Jonker & Volgenant 1987 style): rows are added one at a time and an augmenting path to a
free column is found by a Dijkstra-like scan on reduced costs. Our own implementation; the
inner scan is vectorised with torch (float64). Used to place experts on TileQ's grid cells.
"""

from __future__ import annotations

import torch
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
    n = cost.shape[0]
    a = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    a[1:, 1:] = cost.double()
    u = torch.zeros(n + 1, dtype=torch.float64)
    v = torch.zeros(n + 1, dtype=torch.float64)
    p = [0] * (n + 1)  # p[j]: row matched to column j (1-based, 0 = free)
    way = torch.zeros(n + 1, dtype=torch.int64)
    inf = float("inf")
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = torch.full((n + 1,), inf, dtype=torch.float64)
        used = torch.zeros(n + 1, dtype=torch.bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            cur = a[i0] - u[i0] - v
            better = (~used) & (cur < minv)
            minv = torch.where(better, cur, minv)
            way = torch.where(better, torch.full_like(way, j0), way)
            masked = torch.where(used, torch.full_like(minv, inf), minv)
            masked[0] = inf
            j1 = int(torch.argmin(masked))
            delta = float(masked[j1])
            rows_used = torch.tensor([p[j] for j in range(n + 1) if used[j]], dtype=torch.int64)
            u[rows_used] += delta
            v[used] -= delta
            minv[~used] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = int(way[j0])
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    out = torch.empty(n, dtype=torch.int64)
    for j in range(1, n + 1):
        out[p[j] - 1] = j - 1
    return out
