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


# --------------------------------------------------------------------------------------------
# TileQ's placement as the authors' code does it (``place_blocks_optimized_uv_coherence`` in
# ``get_scale_quant.py``, vendored in nicyyyy/GLoRCQ [K]): independent k-means of the
# flattened, L2-normalised top singular vectors on each side, then ring search for a free cell.


def kmeans(X: Tensor, k: int, *, n_init: int = 10, max_iter: int = 300, seed: int = 0) -> Tensor:
    """Seeded Lloyd k-means with k-means++ starts (the code calls sklearn's
    ``KMeans(n_clusters=k, random_state=0, n_init=10)`` [K]; sklearn is not a dependency, so
    this is our own [I]).

    Args:
        X: ``[n, d]`` float features.
        k: clusters (clipped to ``n`` [I]; sklearn would refuse ``k > n``).
        n_init: seeded restarts; the run with the lowest inertia is kept.
    Returns:
        ``[n]`` int64 labels in ``[0, k)``, renumbered in order of first appearance [I]
        (deterministic for a given seed).
    Raises:
        ValueError: ``X`` not 2-D or empty, ``k < 1`` or ``n_init < 1``.
    """
    if X.dim() != 2 or X.shape[0] == 0:
        raise InvalidValueError(f"X: expected a non-empty [n, d] matrix, got {tuple(X.shape)}")
    if k < 1 or n_init < 1:
        raise InvalidValueError(f"k, n_init: must be >= 1, got {k}, {n_init}")
    X = X.double()
    n = X.shape[0]
    k = min(k, n)
    gen = torch.Generator().manual_seed(seed)
    best, best_inertia = torch.zeros(n, dtype=torch.int64), float("inf")
    for _ in range(n_init):
        centers = [X[int(torch.randint(0, n, (1,), generator=gen))]]
        for _ in range(1, k):
            d2 = torch.cdist(X, torch.stack(centers)).pow(2).min(1).values
            if float(d2.sum()) <= 0:
                idx = int(torch.randint(0, n, (1,), generator=gen))
            else:
                idx = int(torch.multinomial(d2 / d2.sum(), 1, generator=gen))
            centers.append(X[idx])
        C = torch.stack(centers)
        labels = torch.cdist(X, C).argmin(1)
        for _ in range(max_iter):
            for j in range(k):
                members = labels == j
                if members.any():
                    C[j] = X[members].mean(0)
            new = torch.cdist(X, C).argmin(1)
            if torch.equal(new, labels):
                break
            labels = new
        inertia = float((X - C[labels]).pow(2).sum())
        if inertia < best_inertia - 1e-12:
            best, best_inertia = labels, inertia
    order = {}
    for lab in best.tolist():
        order.setdefault(lab, len(order))
    return torch.tensor([order[lab] for lab in best.tolist()], dtype=torch.int64)


def ring_placement(
    row_groups: Tensor, col_groups: Tensor, grid: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Place experts on an ``M × N`` grid at the free cell nearest their (row cluster, column
    cluster) — the code's rule [K]: groups of experts with the same cluster pair, in order of
    first appearance, each member in expert order; rings ``|dr| + |dc| = radius`` around the
    base cell ``(min(rg, M−1), min(cg, N−1))`` with wrap-around, ``dr`` from ``−radius`` up;
    any expert left over takes the first free cell in row-major order.

    Args:
        row_groups, col_groups: ``[K]`` int64 cluster labels.
        grid: ``(M, N)`` with ``M·N >= K``.
    Returns:
        ``(row [K], col [K])`` int64; distinct cells, ``M·N − K`` cells left empty.
    Raises:
        ValueError: fewer cells than experts.
    """
    M, N = grid
    K = row_groups.shape[0]
    if M * N < K:
        raise InvalidValueError(f"grid: {M}x{N} has fewer cells than the {K} experts")
    groups: dict[tuple[int, int], list[int]] = {}
    for e, (rg, cg) in enumerate(zip(row_groups.tolist(), col_groups.tolist(), strict=True)):
        groups.setdefault((rg, cg), []).append(e)
    used = [[False] * N for _ in range(M)]
    row = torch.full((K,), -1, dtype=torch.int64)
    col = torch.full((K,), -1, dtype=torch.int64)
    for (rg, cg), members in groups.items():
        base_r, base_c = min(rg, M - 1), min(cg, N - 1)
        todo = list(members)
        for radius in range(max(M, N) + 1):
            for dr in range(-radius, radius + 1):
                rest = radius - abs(dr)
                for dc in [-rest, rest] if rest else [0]:
                    r, c = (base_r + dr) % M, (base_c + dc) % N
                    if todo and not used[r][c]:
                        e = todo.pop(0)
                        used[r][c] = True
                        row[e], col[e] = r, c
            if not todo:
                break
        for r in range(M):
            for c in range(N):
                if todo and not used[r][c]:
                    e = todo.pop(0)
                    used[r][c] = True
                    row[e], col[e] = r, c
    return row, col
