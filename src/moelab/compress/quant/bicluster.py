"""TileQ's grid assignment: place K = M·N experts on an M × N grid so that experts in one
grid row have similar left (output) subspaces and experts in one column similar right
(input) subspaces ("singular subspace clustering / biclustering", arXiv 2605.09281 [S]).

Subspace similarity is ``sim(A, B) = ‖AᵀB‖²_F`` for orthonormal ``A, B`` (the sum of squared
cosines of the principal angles, in ``[0, r]``).

Algorithm [I] (the paper's procedure is not public; this is the research notes' heuristic
made into one alternating optimisation):

1. per expert the top-r left/right singular subspaces ``P_e, Q_e`` of its weighted target;
2. seed: M row seeds by farthest-point sampling on the left similarity, experts assigned to
   rows by a balanced matching (N slots per row); columns seeded from the first row's members,
   every other row matched onto them by right similarity;
3. alternate: row prototypes ``R_m`` = top-r left singular vectors of ``[P_e]_{e ∈ row m}``,
   column prototypes ``C_n`` likewise from ``[Q_e]_{e ∈ col n}``; then re-place *all* experts
   at once by one K × K minimum-cost matching of experts to cells with cost
   ``−(sim(P_e, R_m) + sim(Q_e, C_n))``; stop when the placement repeats;
4. a few seeded restarts; keep the placement with the highest objective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.compress.quant.assignment import min_cost_assignment
from moelab.errors import InvalidValueError


def _sim(A: Tensor, B: Tensor) -> Tensor:
    """``[Ka, Kb]`` ``‖A_aᵀ B_b‖²_F`` for stacks ``A [Ka, d, r]``, ``B [Kb, d, r]``."""
    return torch.einsum("adr,bds->abrs", A, B).pow(2).sum((-1, -2))


def _prototypes(P: Tensor, groups: Tensor, n_groups: int, r: int) -> Tensor:
    """``[n_groups, d, r]`` top-r left singular vectors of each group's concatenated bases."""
    out = []
    for m in range(n_groups):
        members = P[groups == m]  # [n, d, r]
        cat = members.permute(1, 0, 2).reshape(P.shape[1], -1)
        u = torch.linalg.svd(cat, full_matrices=False).U[:, :r]
        out.append(u)
    return torch.stack(out)


def _objective(
    P: Tensor, Q: Tensor, row_of: Tensor, col_of: Tensor, M: int, N: int, r: int
) -> float:
    R = _prototypes(P, row_of, M, r)
    C = _prototypes(Q, col_of, N, r)
    K = P.shape[0]
    ar = torch.arange(K)
    return float(_sim(P, R)[ar, row_of].sum() + _sim(Q, C)[ar, col_of].sum())


def _seed(SP: Tensor, SQ: Tensor, M: int, N: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    K = SP.shape[0]
    seeds = [int(torch.randint(0, K, (1,), generator=gen))]
    while len(seeds) < M:
        closeness = SP[:, seeds].max(1).values
        closeness[seeds] = float("inf")
        seeds.append(int(torch.argmin(closeness)))
    # balanced rows: slot m·N + j belongs to row m
    cost = -SP[:, seeds].repeat_interleave(N, dim=1)
    slot = min_cost_assignment(cost)
    row_of = slot // N
    col_of = torch.empty(K, dtype=torch.int64)
    first = (row_of == 0).nonzero().flatten()
    col_of[first] = torch.arange(N)
    for m in range(1, M):
        members = (row_of == m).nonzero().flatten()
        cost = -SQ[members][:, first]  # member -> column (the first row's expert in it)
        col_of[members] = col_of[first][min_cost_assignment(cost)]
    return row_of, col_of


def grid_assignment(
    P: Tensor,
    Q: Tensor,
    grid: tuple[int, int],
    *,
    iters: int = 6,
    restarts: int = 3,
    seed: int = 0,
) -> tuple[Tensor, Tensor, float]:
    """Place K experts on an M × N grid by left/right subspace similarity.

    Args:
        P: ``[K, O, r]`` orthonormal left subspaces.
        Q: ``[K, I, r]`` orthonormal right subspaces.
        grid: ``(M, N)`` with ``M·N = K``.
        iters: alternations per restart; restarts: seeded restarts (>= 1).
    Returns:
        ``(row_of [K], col_of [K], objective)``; every cell holds exactly one expert.
    Raises:
        ValueError: the grid does not factor K.
    """
    M, N = grid
    K, r = P.shape[0], P.shape[2]
    if M * N != K:
        raise InvalidValueError(f"grid: {M}x{N} does not factor the {K} experts")
    P, Q = P.double(), Q.double()
    if M == 1 or N == 1:  # a line: every placement gives the same sharing
        ar = torch.arange(K)
        row_of, col_of = (ar // N, ar % N)
        return row_of, col_of, _objective(P, Q, row_of, col_of, M, N, r)
    SP, SQ = _sim(P, P), _sim(Q, Q)
    gen = torch.Generator().manual_seed(seed)
    best: tuple[Tensor, Tensor, float] = (torch.empty(0), torch.empty(0), float("-inf"))
    for _ in range(max(1, restarts)):
        row_of, col_of = _seed(SP, SQ, M, N, gen)
        for _ in range(iters):
            R = _prototypes(P, row_of, M, r)
            C = _prototypes(Q, col_of, N, r)
            score_r, score_c = _sim(P, R), _sim(Q, C)  # [K, M], [K, N]
            cost = -(score_r.repeat_interleave(N, dim=1) + score_c.repeat(1, M))  # cell m·N + n
            cell = min_cost_assignment(cost)
            new_row, new_col = cell // N, cell % N
            if torch.equal(new_row, row_of) and torch.equal(new_col, col_of):
                break
            row_of, col_of = new_row, new_col
        obj = _objective(P, Q, row_of, col_of, M, N, r)
        if obj > best[2]:
            best = (row_of, col_of, obj)
    return best
