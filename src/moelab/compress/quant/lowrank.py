"""Fitting low-rank compensation of expert quantization errors (activation-weighted).

Two TileQ forms (arXiv 2605.09281) live here:

- ``tileq`` (:func:`fit_tileq`) — as the authors' code does it (TileQ's 2-D routines
  ``get_experts_2Dlora`` / ``place_blocks_optimized_uv_coherence`` in ``get_scale_quant.py``,
  vendored in nicyyyy/GLoRCQ; the first author's LoPRo code grysgreat/Sketch_lopro for the
  per-matrix form [K]): per-expert AWQ-style input scales :func:`awq_scale`, the scaled
  weights ``B_e = diag(s_e) W_eᵀ`` placed on the grid by :func:`tileq_placement`, one
  truncated SVD of the zero-padded block matrix with one shared ``Σ``; the pipeline fits it
  to ``W`` once and quantizes the residual (``target="weight-once"``);
- ``tileq-core`` (:func:`fit_tileq_core`) — moelab's own reconstruction (described below):
  HOSVD + HOOI with an r × r core per expert, a strict generalisation we measured.

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
- tileq-core 2-D: grid placement (:mod:`moelab.compress.quant.bicluster`), one-shot HOSVD
  (``U_m`` from the row's concatenation, ``V_n`` from the column's stack), then ``sweeps``
  HOOI refinement sweeps (``U_m`` from ``[T_e D V_n]_{e∈m}``, ``V_n`` from
  ``[(T_e D)ᵀ U_m]_{e∈n}``), cores ``S_e = U_mᵀ (T_e D) V_n``.

Each step maximises the captured energy ``Σ_e ‖U_mᵀ T_e D V_n‖²_F`` (HOOI is monotone in it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.compress.quant.bicluster import grid_assignment, kmeans, ring_placement
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


def fit_tileq_core(
    T: Tensor,
    d: Tensor,
    rank: int,
    grid: tuple[int, int],
    *,
    sweeps: int = 2,
    seed: int = 0,
) -> tuple[LowRankFactors, float]:
    """moelab's TileQ variant (``tileq-core``): grid placement, HOSVD, ``sweeps`` HOOI sweeps,
    r × r cores.

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
    factors = LowRankFactors(
        "tileq-core", U.float(), _unweigh(V, d).float(), row_of, col_of, S.float()
    )
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
    per_expert_scale: bool = False,
) -> LowRankFactors:
    """Dispatch to :func:`fit_per_expert` (:func:`fit_per_expert_scaled`),
    :func:`fit_shared_1d`, :func:`fit_tileq_core` or :func:`fit_tileq`.

    Args:
        d: ``[I]`` diagonal or ``[I, I]`` whitening shared by the experts; with
            ``per_expert_scale`` a ``[K, I]`` positive diagonal scale per expert (per-expert
            and tileq only; tileq broadcasts a shared ``[I]`` diagonal to its experts).
    Raises:
        ValueError: unknown scheme, tileq without a grid, or a weighting the scheme cannot use.
    """
    if scheme in ("tileq", "tileq-core") and grid is None:
        raise InvalidValueError(f"grid: {scheme} needs an M x N grid")
    if scheme == "tileq":
        if not per_expert_scale:
            if d.dim() != 1:
                raise InvalidValueError(
                    "weighting: tileq needs a diagonal input scale (awq or diag), not a matrix"
                )
            d = d.expand(T.shape[0], -1)
        return fit_tileq(T, d, rank, grid, seed=seed)[0].float()  # float32 like the others
    if per_expert_scale:
        if scheme != "per-expert":
            raise InvalidValueError(
                f"weighting: per-expert input scales need per-expert or tileq, not {scheme!r}"
            )
        return fit_per_expert_scaled(T, d, rank)
    if scheme == "per-expert":
        return fit_per_expert(T, d, rank)
    if scheme == "shared-1d":
        return fit_shared_1d(T, d, rank)
    if scheme == "tileq-core":
        return fit_tileq_core(T, d, rank, grid, sweeps=sweeps, seed=seed)[0]
    raise InvalidValueError(
        f"scheme: must be per-expert, shared-1d, tileq or tileq-core, got {scheme!r}"
    )


def lowrank_extra_params(
    scheme: str,
    num_experts: int,
    d_in: int,
    d_out: int,
    rank: int,
    grid: tuple[int, int] | None = None,
) -> int:
    """Analytic extra parameters as stored (research notes §(b) step 6): per-expert
    ``K·r·(I+O)``, shared-1d ``r·I + K·r·O``, tileq-core ``M·r·O + N·r·I + K·r²``, tileq
    (code orientation: M input-side, N output-side factors, Σ folded in, per-expert input
    un-scaling) ``r·(M·I + N·O) + K·I``. See :func:`tileq_code_lora_params` for the code's own
    count."""
    K, r = num_experts, rank
    if scheme == "per-expert":
        return K * r * (d_in + d_out)
    if scheme == "shared-1d":
        return r * d_in + K * r * d_out
    if scheme == "tileq-core":
        M, N = grid
        return M * r * d_out + N * r * d_in + K * r * r
    if scheme == "tileq":
        M, N = grid
        return r * (M * d_in + N * d_out) + K * d_in
    raise InvalidValueError(f"scheme: unknown {scheme!r}")


def tileq_code_lora_params(grid: tuple[int, int], d_in: int, d_out: int, rank: int) -> int:
    """The code's count of TileQ's low-rank entries [K]: ``lora_size = srank·(row·O + col·I)``
    (``get_experts_2Dlora``, ``get_scale_quant.py``; ``row = M``, ``col = N``). It leaves out
    the shared ``Σ`` (r numbers) and the per-expert ``Sa_e`` (``K·I``), and its orientation
    is swapped against what it stores (``U_all`` holds ``M·I``, ``V_all`` ``N·O`` entries per
    rank) — equal only when ``M = N`` or ``I = O``. Reported beside
    :func:`lowrank_extra_params` (what moelab stores)."""
    M, N = grid
    return rank * (M * d_out + N * d_in)


# --------------------------------------------------------------------------- tileq (code form)

AWQ_EXPONENT = 2.4  # [K] get_experts_2Dlora: scale_time = 2.4
AWQ_STEP = 0.2  # [K] lowered by 0.2 ...
AWQ_MIN_EXPONENT = 0.5  # [K] ... down to 0.5 ...
AWQ_MAX_RATIO = 1e5  # [K] ... while max/min >= 1e5 ...
AWQ_ATTEMPTS = 10  # [K] ... at most 10 times
AWQ_CLAMP_MIN = 1e-4  # llm-awq auto_scale: x_max.pow(ratio).clamp(min=1e-4); [K]'s SCALE_CLAMP_MIN
DROP_ABOVE = 60.0  # [K] get_layers_2Dlora: the term is dropped if max|W − L| > 60


def awq_scale(mean_abs: Tensor, counts: Tensor | None = None) -> Tensor:
    """Per-expert AWQ-style input scales ``s_e`` ``[K, I]`` float64, as the code computes them
    (``get_proper_scale`` in ``get_experts_2Dlora``, ``get_scale_quant.py`` [K]):
    ``f / sqrt(max f · min f)`` with ``f = max(m^p, 1e-4)`` and ``m = mean_t |x_{e,t}|`` over
    the expert's own routed rows, ``p = 2.4`` lowered by 0.2 (not below 0.5, at most 10
    times) while ``max s / min s >= 1e5``.

    The floor 1e-4 is llm-awq's (``auto_scale``: ``x_max.pow(ratio).clamp(min=1e-4)``, also
    AutoAWQ's) and the TileQ code's for the float16 features its models produce
    (``SCALE_CLAMP_MIN``); the code's float32 branch floors at 1e-15, which an input channel
    that is zero on every calibration row turns into scales spanning ~1e15, factors ``Ṽ = V/s``
    beyond float16 and NaN outputs, so moelab (computing in float64) always uses 1e-4. Then
    ``1/s <= sqrt(max f / 1e-4)``.

    Args:
        mean_abs: ``[K, I]`` mean absolute input per expert
            (:meth:`~moelab.compress.quant.hessian.HessianAccumulator.mean_abs`).
        counts: ``[K]`` rows per expert; an expert with none gets ones (the code feeds it
            ``ones(2, I)`` features, which gives ones [K]).
    Raises:
        ValueError: ``mean_abs`` not ``[K, I]``, negative or not finite.
    """
    if mean_abs.dim() != 2:
        raise InvalidValueError(f"mean_abs: expected [K, I], got {tuple(mean_abs.shape)}")
    m = mean_abs.double()
    if not torch.isfinite(m).all() or (m < 0).any():
        raise InvalidValueError("mean_abs: must be finite and >= 0")
    out = torch.ones_like(m)
    for e in range(m.shape[0]):
        if counts is not None and int(counts[e]) == 0:
            continue
        p = AWQ_EXPONENT
        for _ in range(AWQ_ATTEMPTS):
            f = m[e].pow(p).clamp_min(AWQ_CLAMP_MIN)
            sc = f / torch.sqrt(f.max() * f.min())
            if float(sc.max() / sc.min()) < AWQ_MAX_RATIO:
                break
            p = max(AWQ_MIN_EXPONENT, p - AWQ_STEP)
        out[e] = sc
    return out


def _check_scales(T: Tensor, s: Tensor) -> None:
    if T.dim() != 3 or s.shape != (T.shape[0], T.shape[2]):
        raise InvalidValueError(
            f"T, s: expected [K, O, I] and [K, I], got {tuple(T.shape)}, {tuple(s.shape)}"
        )
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise InvalidValueError("s: input scales must be finite and > 0")


def fit_per_expert_scaled(T: Tensor, s: Tensor, rank: int) -> LowRankFactors:
    """Per-expert rank-r factors of ``T [K, O, I]`` with each expert's own diagonal input
    scale ``s [K, I]``: truncated SVD of ``T_e diag(s_e)``, un-scaled into ``Ṽ_e`` — the
    per-matrix form of the authors' pipeline (``get_normal_lora`` / LoPRo's
    ``sketch_pre_split``, with an exact SVD instead of the sketch [I]). Returns float32
    factors."""
    _check(T, torch.ones(T.shape[2]), rank)
    _check_scales(T, s)
    s = s.double()
    A = T.double() * s.unsqueeze(1)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    Uf = U[:, :, :rank] * S[:, None, :rank]
    Vf = Vh[:, :rank, :].transpose(1, 2) / s.unsqueeze(-1)
    ar = torch.arange(T.shape[0])
    return LowRankFactors("per-expert", Uf.float(), Vf.float(), ar, ar)


def _fix_signs(X: Tensor) -> Tensor:
    """[I] flip each singular vector (column of ``X [.., d, s]``) so that its largest-magnitude
    entry is positive. The code's sketch vectors carry whatever sign the iteration gives;
    flattened features need a fixed convention to be comparable, and each side gets its own
    (the U and V features are clustered independently, so a pair need not flip together)."""
    idx = X.abs().argmax(-2, keepdim=True)
    sign = torch.sign(torch.gather(X, -2, idx))
    sign[sign == 0] = 1
    return X * sign


def tileq_placement(
    B: Tensor, grid: tuple[int, int], rank: int, *, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """TileQ's grid placement as the code does it (``place_blocks_optimized_uv_coherence``
    [K]): per expert the top ``s = r/2`` singular vectors of the scaled weight ``B_e``
    (``U [I, s]``, ``V [O, s]``; ``s = max(1, r // 2)`` clipped to ``min(I, O)`` [I]) are
    flattened and L2-normalised; k-means into M clusters on the U features (grid rows: the
    input side) and, independently, into N clusters on the V features (columns: the output
    side); :func:`~moelab.compress.quant.bicluster.ring_placement` puts each expert on the
    nearest free cell. Exact SVD (float64) instead of the fp16 sketch, our k-means instead of
    sklearn's [I].

    Args:
        B: ``[K, I, O]`` scaled transposed weights ``diag(s_e) W_eᵀ``.
        grid: ``(M, N)`` with ``M·N >= K``.
    Returns:
        ``(row [K], col [K])`` int64: grid row (input-side factor) and column (output-side).
    """
    M, N = grid
    K, I, O = B.shape  # noqa: E741
    s = max(1, min(rank // 2, I, O))
    U, _, Vh = torch.linalg.svd(B.double(), full_matrices=False)
    Us, Vs = _fix_signs(U[:, :, :s]), _fix_signs(Vh[:, :s, :].transpose(1, 2))

    def features(X: Tensor) -> Tensor:
        f = X.reshape(K, -1)
        n = f.norm(dim=1, keepdim=True)
        return f / torch.where(n > 0, n, torch.ones_like(n))

    zeros = torch.zeros(K, dtype=torch.int64)
    rows = zeros if M == 1 else kmeans(features(Us), M, seed=seed)
    cols = zeros if N == 1 else kmeans(features(Vs), N, seed=seed)
    return ring_placement(rows, cols, grid)


def fit_tileq(
    T: Tensor,
    s: Tensor,
    rank: int,
    grid: tuple[int, int],
    *,
    seed: int = 0,
    cells: tuple[Tensor, Tensor] | None = None,
    drop_above: float | None = DROP_ABOVE,
) -> tuple[LowRankFactors, float]:
    """TileQ's 2-D factors as the authors' code fits them (``get_experts_2Dlora`` [K]).

    1. ``B_e = diag(s_e) T_eᵀ`` ``[I, O]`` (the pipeline passes ``T = W`` and the AWQ scale);
    2. placement on the ``M × N`` grid (:func:`tileq_placement`, unless ``cells`` is given);
    3. the zero-padded block matrix ``A [M·I, N·O]`` with ``B_e`` at its cell (empty cells
       stay zero) and one rank-r truncated SVD ``A ≈ P Σ Qᵀ`` (exact, float64 [I]; the code
       uses an 8-iteration power-iteration sketch with fp8 vectors);
    4. expert ``e`` at ``(m, n)``: ``L_e = (diag(Sa_e) P_m Σ Q_nᵀ)ᵀ`` with ``Sa_e = 1/s_e``,
       one Σ for the whole projection (no per-expert core). Stored as
       :class:`LowRankFactors` ``"tileq"``: ``U [N, O, r] = Q_n Σ`` (Σ folded in [I]),
       ``V [M, I, r] = P_m``, ``in_scale = Sa`` (clamped to float16's normal range
       [6.2e-5, 6e4]; [I]), ``row_of = n``, ``col_of = m``;
    5. an expert with ``max|T_e − L_e| > drop_above`` (60 in the code [K]) gets no term
       (``in_scale_e = 0``).

    Args:
        T: ``[K, O, I]`` what to approximate (float).
        s: ``[K, I]`` positive input scales (:func:`awq_scale`).
        rank: ``1 <= r <= min(M·I, N·O)``.
        grid: ``(M, N)``: M grid rows share an input-side factor, N columns an output-side
            one; ``M·N >= K``.
        cells: optional fixed ``(row [K], col [K])`` placement.
        drop_above: the drop threshold (None: never drop).
    Returns:
        ``(factors, captured)``: float64 factors and the fraction of ``‖A‖²_F`` the rank-r
        SVD captures.
    Raises:
        ValueError: shapes, scales, rank or grid out of range.
    """
    _check_scales(T, s)
    K, O, I = T.shape  # noqa: E741
    M, N = grid
    if M < 1 or N < 1 or M * N < K:
        raise InvalidValueError(f"grid: {M}x{N} has fewer cells than the {K} experts")
    if not isinstance(rank, int) or not 1 <= rank <= min(M * I, N * O):
        raise InvalidValueError(f"rank: must be in [1, {min(M * I, N * O)}], got {rank!r}")
    s = s.double()
    B = s.unsqueeze(-1) * T.double().transpose(1, 2)  # [K, I, O]
    row, col = cells if cells is not None else tileq_placement(B, grid, rank, seed=seed)
    A = torch.zeros(M, I, N, O, dtype=torch.float64)
    A[row, :, col, :] = B
    A = A.view(M * I, N * O)
    P, S, Qh = torch.linalg.svd(A, full_matrices=False)
    V = P[:, :rank].reshape(M, I, rank)
    U = (Qh[:rank].T * S[:rank]).reshape(N, O, rank)
    total = float(S.pow(2).sum())
    captured = float(S[:rank].pow(2).sum()) / total if total > 0 else 1.0
    Sa = (1.0 / s).clamp(6.2e-5, 6.0e4)
    factors = LowRankFactors("tileq", U, V, col, row, in_scale=Sa)
    if drop_above is not None:
        dropped = (T.double() - factors.dense()).abs().amax((1, 2)) > drop_above
        if dropped.any():
            factors.in_scale[dropped] = 0.0
    return factors, captured


def tileq_grid(num_experts: int) -> tuple[int, int]:
    """Default TileQ grid ``(M, N)`` [I]: ``M`` = the smallest power of two ``>= √K`` grid
    rows (input-side factors), ``N = ceil(K / M)`` columns. It gives the code's row lengths
    (``row_len`` 4 for Mixtral's 8 experts → 4×2; 8 for Qwen1.5-MoE's 60 → 8×8 with 4 empty
    cells [K]) and ``√K × √K`` for square K (the paper's recommendation [S]).

    Raises:
        ValueError: ``num_experts < 1``.
    """
    if num_experts < 1:
        raise InvalidValueError(f"num_experts: must be >= 1, got {num_experts}")
    M = 1
    while num_experts > M * M:
        M *= 2
    return M, -(-num_experts // M)
