"""Fitting low-rank compensation of expert quantization errors (activation-weighted).

Target (the research notes' option A, LQER / MiLo style "quantise then compensate" [I]): for
each expert ``T_e = W_e − Q(W_e)`` ``[O, I]`` (the pipeline can also pass ``W_e`` itself, the
notes' option B), weighted on the input side by a layer-shared activation weighting ``D`` so
that the fitted ``L_e`` minimises ``‖(T_e − L_e) D‖_F``. ``D`` is either the notes'
``diag(sqrt(diag H))`` (:func:`activation_scale`, a vector ``d [I]``) or the full symmetric
``(H + λI)^{1/2}`` (:func:`activation_whitening`, a matrix ``[I, I]``; then the objective is
the damped output error itself). One ``D`` per projection and layer (pooled over all routed
rows) keeps a column-shared factor valid for every expert of the column; we use it for all
three schemes so only the sharing differs between them [I]. Stored factors carry ``D⁻¹``
(``Ṽ = D⁻¹V``).

- per-expert: truncated SVD of ``T_e D`` (``U = U_r Σ_r``, no core);
- shared-1d (MiLo-style): ``V`` = top-r right singular vectors of the stacked ``[T_e D]_e``,
  ``U_e = T_e D V``;
- TileQ 2-D: grid placement (:mod:`moelab.compress.quant.bicluster`), one-shot HOSVD
  (``U_m`` from the row's concatenation, ``V_n`` from the column's stack), then ``sweeps``
  HOOI refinement sweeps (``U_m`` from ``[T_e D V_n]_{e∈m}``, ``V_n`` from
  ``[(T_e D)ᵀ U_m]_{e∈n}``), cores ``S_e = U_mᵀ (T_e D) V_n``.

Each step maximises the captured energy ``Σ_e ‖U_mᵀ T_e D V_n‖²_F`` (HOOI is monotone in it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.compress.quant.bicluster import grid_assignment
from moelab.core.experts.lowrank import LowRankFactors
from moelab.errors import InvalidValueError


def activation_scale(H: Tensor, eps: float = 1e-6) -> Tensor:
    """``[I]`` float64 ``sqrt(diag H + eps·mean(diag H))`` (never zero).

    Args:
        H: ``[I, I]`` pooled second moment (or its diagonal ``[I]``); all-zero gives ones.
    """
    diag = torch.diagonal(H).double() if H.dim() == 2 else H.double()
    mean = float(diag.mean())
    if mean <= 0:
        return torch.ones_like(diag)
    return torch.sqrt(diag.clamp_min(0) + eps * mean)


def activation_whitening(H: Tensor, damp: float = 0.01) -> Tensor:
    """``[I, I]`` float64 symmetric ``(H + damp·mean(diag H)·I)^{1/2}`` — the full
    activation weighting: ``‖ΔW S‖_F² = tr(ΔW (H + λI) ΔWᵀ)`` is the (damped) output error.
    An all-zero ``H`` gives the identity."""
    H = H.double()
    mean = float(torch.diagonal(H).mean())
    if mean <= 0:
        return torch.eye(H.shape[0], dtype=torch.float64)
    vals, vecs = torch.linalg.eigh(H + damp * mean * torch.eye(H.shape[0], dtype=torch.float64))
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def _weigh(T: Tensor, d: Tensor) -> Tensor:
    """``T·D``: ``d [I]`` a diagonal scale or ``d [I, I]`` a symmetric whitening."""
    return T.double() * d if d.dim() == 1 else T.double() @ d


def _unweigh(V: Tensor, d: Tensor) -> Tensor:
    """``D⁻¹·V`` for ``V [.., I, r]`` (what the stored column factors carry)."""
    if d.dim() == 1:
        return V / d.unsqueeze(-1)
    return torch.linalg.solve(d, V)


def _top_eigvecs(S: Tensor, r: int) -> Tensor:
    """Top-r eigenvectors (columns) of a symmetric PSD matrix."""
    _, vecs = torch.linalg.eigh(S)
    return vecs[:, -r:].flip(-1)


def _top_left(blocks: Tensor, r: int) -> Tensor:
    """Top-r left singular vectors of the horizontal concatenation of ``blocks [n, d, r']``
    (a thin ``[d, n·r']`` SVD; the HOOI update)."""
    cat = blocks.permute(1, 0, 2).reshape(blocks.shape[1], -1)
    return torch.linalg.svd(cat, full_matrices=False).U[:, :r]


def _check(T: Tensor, d: Tensor, rank: int) -> None:
    if T.dim() != 3 or d.shape not in ((T.shape[2],), (T.shape[2], T.shape[2])):
        raise InvalidValueError(
            f"T, d: expected [K, O, I] and [I] or [I, I], got {tuple(T.shape)}, {tuple(d.shape)}"
        )
    if not isinstance(rank, int) or not 1 <= rank <= min(T.shape[1], T.shape[2]):
        raise InvalidValueError(
            f"rank: must be in [1, {min(T.shape[1], T.shape[2])}], got {rank!r}"
        )


def fit_per_expert(T: Tensor, d: Tensor, rank: int) -> LowRankFactors:
    """Per-expert rank-r factors of ``T [K, O, I]`` weighted by ``d [I]``."""
    _check(T, d, rank)
    A = _weigh(T, d)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    Uf = U[:, :, :rank] * S[:, None, :rank]
    Vf = _unweigh(Vh[:, :rank, :].transpose(1, 2), d)
    ar = torch.arange(T.shape[0])
    return LowRankFactors("per-expert", Uf.float(), Vf.float(), ar, ar)


def fit_shared_1d(T: Tensor, d: Tensor, rank: int) -> LowRankFactors:
    """One input-side factor shared by all experts, a row factor per expert."""
    _check(T, d, rank)
    A = _weigh(T, d)
    V = _top_eigvecs(torch.einsum("koi,koj->ij", A, A), rank)  # [I, r]
    Uf = A @ V  # [K, O, r]
    K = T.shape[0]
    return LowRankFactors(
        "shared-1d",
        Uf.float(),
        _unweigh(V, d).unsqueeze(0).float(),
        torch.arange(K),
        torch.zeros(K, dtype=torch.int64),
    )


def fit_tileq(
    T: Tensor,
    d: Tensor,
    rank: int,
    grid: tuple[int, int],
    *,
    sweeps: int = 2,
    seed: int = 0,
) -> tuple[LowRankFactors, float]:
    """TileQ 2-D factors: grid placement, HOSVD, ``sweeps`` HOOI sweeps, r × r cores.

    Returns:
        ``(factors, captured)`` where ``captured`` is the fraction of ``Σ‖T_e D‖²`` the
        factors represent.
    Raises:
        ValueError: the grid does not factor K, or the rank is out of range.
    """
    _check(T, d, rank)
    K = T.shape[0]
    M, N = grid
    if M * N != K:
        raise InvalidValueError(f"grid: {M}x{N} does not factor the {K} experts")
    if sweeps < 0:
        raise InvalidValueError(f"sweeps: must be >= 0, got {sweeps}")
    A = _weigh(T, d)
    U0, _, Vh0 = torch.linalg.svd(A, full_matrices=False)
    row_of, col_of, _ = grid_assignment(
        U0[:, :, :rank], Vh0[:, :rank, :].transpose(1, 2), grid, seed=seed
    )
    AAt = A @ A.transpose(1, 2)  # [K, O, O]
    AtA = A.transpose(1, 2) @ A  # [K, I, I]
    U = torch.stack([_top_eigvecs(AAt[row_of == m].sum(0), rank) for m in range(M)])
    V = torch.stack([_top_eigvecs(AtA[col_of == n].sum(0), rank) for n in range(N)])
    for _ in range(sweeps):
        AV = A @ V[col_of]  # [K, O, r]
        U = torch.stack([_top_left(AV[row_of == m], rank) for m in range(M)])
        AtU = A.transpose(1, 2) @ U[row_of]  # [K, I, r]
        V = torch.stack([_top_left(AtU[col_of == n], rank) for n in range(N)])
    S = U[row_of].transpose(1, 2) @ A @ V[col_of]  # [K, r, r]
    total = float(A.pow(2).sum())
    captured = float(S.pow(2).sum()) / total if total > 0 else 1.0
    factors = LowRankFactors("tileq", U.float(), _unweigh(V, d).float(), row_of, col_of, S.float())
    return factors, captured


def fit_lowrank(
    scheme: str,
    T: Tensor,
    d: Tensor,
    rank: int,
    grid: tuple[int, int] | None = None,
    *,
    sweeps: int = 2,
    seed: int = 0,
) -> LowRankFactors:
    """Dispatch to :func:`fit_per_expert`, :func:`fit_shared_1d` or :func:`fit_tileq`.

    Raises:
        ValueError: unknown scheme, or tileq without a grid.
    """
    if scheme == "per-expert":
        return fit_per_expert(T, d, rank)
    if scheme == "shared-1d":
        return fit_shared_1d(T, d, rank)
    if scheme == "tileq":
        if grid is None:
            raise InvalidValueError("grid: tileq needs an M x N grid")
        return fit_tileq(T, d, rank, grid, sweeps=sweeps, seed=seed)[0]
    raise InvalidValueError(f"scheme: must be per-expert, shared-1d or tileq, got {scheme!r}")


def lowrank_extra_params(
    scheme: str,
    num_experts: int,
    d_in: int,
    d_out: int,
    rank: int,
    grid: tuple[int, int] | None = None,
) -> int:
    """Analytic extra parameters of a scheme (research notes §(b) step 6):
    per-expert ``K·r·(I+O)``, shared-1d ``r·I + K·r·O``, tileq ``M·r·O + N·r·I + K·r²``."""
    K, r = num_experts, rank
    if scheme == "per-expert":
        return K * r * (d_in + d_out)
    if scheme == "shared-1d":
        return r * d_in + K * r * d_out
    if scheme == "tileq":
        M, N = grid
        return M * r * d_out + N * r * d_in + K * r * r
    raise InvalidValueError(f"scheme: unknown {scheme!r}")
