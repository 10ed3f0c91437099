"""GPTVQ (van Baalen et al., 2024, arXiv 2402.15319), batched over the experts of a bank.

GPTQ's column loop (:mod:`moelab.compress.quant.gptq`) with vector quantization: the columns
are taken ``d`` at a time, each row's ``d`` weights replaced by the nearest centroid of its
codebook (format: :mod:`moelab.core.experts.vqformat`), and the ``d`` columns' errors
``err_t = (w_t − q_t) / U_tt`` spread over the columns not yet quantized
(``W_{:, >} −= Σ_t err_t · U_{t, >}``, ``U`` the upper Cholesky factor of ``H⁻¹``). As in the
authors' code (Qualcomm-AI-research/gptvq, ``gptq.py`` ``fasterquant(use_vq=True)`` and
``vq_quant.py``):

- a codebook is fitted when the loop reaches the first column of its block of
  ``group_size`` columns, from the weights as the earlier lazy blocks left them, for every
  block of ``rows`` output rows at once: importance-weighted k-means (``kmeans_iters``
  iterations) initialised at ``K`` points evenly spaced in Mahalanobis distance from the
  mean (the code's ``mahalanobis_init``), then its coordinates quantized to int8 with one
  symmetric scale per codebook;
- the loop assigns each vector to its nearest centroid under the same importance weights
  ("Hessian-weighted lookups");
- the "M-step" afterwards refits every codebook to the layer objective
  ``tr((W − Ŵ) H (W − Ŵ)ᵀ)`` with the assignments fixed, then rounds it to int8 again.

Choices of this project [I]:
- importance weight of column ``j``: ``1 / U_jj²``, the weight GPTQ's own loss gives a
  column's squared error (``Losses = (w − q)² / d²``). The authors' code weights its k-means
  by ``U_jj`` and its lookups by ``1 / U_jj``;
- the M-step takes 25 conjugate-gradient steps on the least-squares problem's normal
  equations (per block of rows; the blocks are independent) where the code takes 25 Adam
  steps towards the same minimiser, and keeps the refit only where it lowers the objective
  after rounding (the code restarts Adam with a smaller step when the loss rises);
- k-means stops once no assignment changes (a fixed point: further iterations change
  nothing); an empty cluster keeps its centroid (the code's M-step moves it to 0);
- columns no calibration row reached keep their weights (as moelab's GPTQ) and the
  codebook scale is rounded up to float16 (as its scalar scales), so the stored scale is
  the one the int8 coordinates were rounded against;
- no blockwise data normalisation (the code's optional ``--vq-scaling-blocksize``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.compress.quant.gptq import dampened, inverse_cholesky
from moelab.compress.quant.rtn import round_scale_up
from moelab.core.experts.vqformat import (
    CODEBOOK_BITS,
    CODEBOOK_QMAX,
    check_vq_format,
    num_centroids,
    vq_dequantize,
)
from moelab.errors import InvalidValueError


@dataclass
class VQTensor:
    """Centroid indices and codebooks of ``W [E, O, I]`` (:mod:`moelab.core.experts.vqformat`).

    Attributes:
        codes: ``[E, O, I/d]`` int64 in ``[0, K)``.
        codebook: ``[E, O/rows, I/group_size, K, d]`` int8.
        scales: ``[E, O/rows, I/group_size]`` float16.
        bits, vq_dim, rows, group_size: the format.
    """

    codes: Tensor
    codebook: Tensor
    scales: Tensor
    bits: int
    vq_dim: int
    rows: int
    group_size: int

    zeros = None  # the format's facts, read like QuantizedTensor's: no zero points,
    g_idx = None  # no act-order groups

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[E, O, I]`` float weights."""
        return vq_dequantize(
            self.codes, self.codebook, self.scales, self.rows, self.group_size, dtype
        )


def gptvq_quantize(
    W: Tensor,
    H: Tensor,
    bits: int,
    vq_dim: int,
    group_size: int,
    rows: int,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    kmeans_iters: int = 100,
    m_step: bool = True,
) -> VQTensor:
    """Vector-quantize ``W [E, O, I]`` with per-expert Hessians ``H [E, I, I]``.

    Args:
        W: weights, any float dtype (computed in float32).
        H: positive semi-definite Hessians (only relative values matter besides the
            dampening).
        bits: bits per dimension, 2 to 4 (``K = 2^(bits·vq_dim)`` centroids, at most 256).
        vq_dim: vector length d (1, 2 or 4).
        group_size: input columns per codebook; a multiple of d dividing I.
        rows: output rows per codebook; divides O; ``rows·group_size/d >= K``.
        damp: GPTQ's dampening fraction of the mean Hessian diagonal, in (0, 1].
        block_size: lazy-batch width (rounded to a multiple of ``group_size``).
        kmeans_iters: k-means iterations per codebook (the authors run 100), >= 0.
        m_step: refit the codebooks to the layer objective after the loop.
    Returns:
        :class:`VQTensor`.
    Raises:
        ValueError: shapes or settings out of range; a Hessian that is not finite.
    """
    if W.dim() != 3 or H.shape != (W.shape[0], W.shape[2], W.shape[2]):
        raise InvalidValueError(
            f"W, H: expected [E, O, I] and [E, I, I], got {tuple(W.shape)}, {tuple(H.shape)}"
        )
    E, O, I = W.shape  # noqa: E741
    d, g, R = vq_dim, group_size, rows
    check_vq_format(bits, d)
    K = num_centroids(bits, d)
    if g < d or g % d or I % g or R < 1 or O % R or R * g // d < K:
        raise InvalidValueError(
            f"group_size, rows: {R} rows × {g} columns must tile W [{O}, {I}] in whole "
            f"vectors of {d} and hold at least {K} of them"
        )
    if not 0 < damp <= 1 or kmeans_iters < 0:
        raise InvalidValueError(f"damp in (0, 1] and kmeans_iters >= 0, got {damp}, {kmeans_iters}")
    if not torch.isfinite(H).all():
        raise InvalidValueError("H: contains NaN or Inf")
    G_obj = H.detach().double()
    U = inverse_cholesky(dampened(H, damp))
    u_diag = torch.diagonal(U, dim1=1, dim2=2)  # [E, I]
    importance = u_diag.pow(-2)
    blk = max(g, (block_size // g) * g)
    W0 = W.detach().float()
    W = W0.clone()
    Gr, Gc = O // R, I // g
    codes = torch.zeros(E, O, I // d, dtype=torch.long)
    codebook = torch.zeros(E, Gr, Gc, K, d)  # scale · int8, what the loop assigns to
    cb_int = torch.zeros(E, Gr, Gc, K, d, dtype=torch.int8)
    scales = torch.zeros(E, Gr, Gc, dtype=torch.float16)
    for i1 in range(0, I, blk):
        i2 = min(i1 + blk, I)
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        for i in range(0, i2 - i1, d):
            col = i1 + i
            c = col // g
            if col % g == 0:  # the authors' find_params(W[:, col : col + g])
                cb = _fit_codebooks(
                    W[:, :, col : col + g], importance[:, col : col + g], R, K, d, kmeans_iters
                )
                cb_int[:, :, c], scales[:, :, c] = _round_codebooks(cb)
                codebook[:, :, c] = cb
            w = W1[:, :, i : i + d]  # [E, O, d]
            wt = importance[:, col : col + d]  # [E, d]
            idx = _nearest(w.reshape(E, Gr, R, d), codebook[:, :, c], wt.view(E, 1, 1, d))
            codes[:, :, col // d] = idx.view(E, O)
            q = codebook[:, :, c].gather(2, idx.unsqueeze(-1).expand(E, Gr, R, d)).view(E, O, d)
            err = (w - q) / u_diag[:, col : col + d].unsqueeze(1)
            W1[:, :, i + d :] -= torch.bmm(err, U1[:, i : i + d, i + d :])
            Err1[:, :, i : i + d] = err
        if i2 < I:
            W[:, :, i2:] -= torch.bmm(Err1, U[:, i1:i2, i2:])
    vq = VQTensor(codes, cb_int, scales, bits, d, R, g)
    if m_step:
        _refit_codebooks(vq, W0, G_obj)
    return vq


AUTHORS_CODEBOOK_BITS_PER_WEIGHT = 0.125
"""The authors' configurations size each codebook so its 8-bit centroids cost 0.125 bits per
weight (``--groupsize`` = ``K·d·8 / 0.125``: 2,048 weights at 2 bits × 2 dimensions)."""


def codebook_rows(bits: int, vq_dim: int, group_size: int, widths: list[int]) -> int:
    """Output rows per codebook for :func:`gptvq_quantize`: the common divisor ``R`` of every
    output width in ``widths`` whose codebook (``R × group_size`` weights) is nearest, in
    ratio, to the authors' size (:data:`AUTHORS_CODEBOOK_BITS_PER_WEIGHT`), among those
    holding at least ``K = 2^(bits·d)`` vectors.

    Raises:
        ValueError: no common divisor gives a codebook that many vectors.
    """
    check_vq_format(bits, vq_dim)
    K = num_centroids(bits, vq_dim)
    target = K * vq_dim * CODEBOOK_BITS / AUTHORS_CODEBOOK_BITS_PER_WEIGHT / group_size
    common = math.gcd(*widths)
    fits = [r for r in range(1, common + 1) if common % r == 0 and r * group_size >= K * vq_dim]
    if not fits:
        raise InvalidValueError(
            f"vq_rows: no row count dividing the widths {widths} gives a codebook of "
            f"{group_size} columns the {K} vectors of {vq_dim} its {K} centroids need"
        )
    return min(fits, key=lambda r: abs(math.log(r / target)))


def _codebook_points(X: Tensor, weight: Tensor, R: int, d: int) -> tuple[Tensor, Tensor]:
    """``X [E, O, g]``, column weights ``[E, g]`` → points and weights ``[E, Gr, R·g/d, d]``
    of every codebook (rows ``R`` at a time, each row cut into vectors of ``d``)."""
    E, rows, g = X.shape
    pts = X.reshape(E, rows // R, R * g // d, d)
    w = weight.view(E, 1, 1, g // d, d).expand(E, rows // R, R, g // d, d)
    return pts, w.reshape(E, rows // R, R * g // d, d)


def _nearest(x: Tensor, centroids: Tensor, weight: Tensor) -> Tensor:
    """Index of the nearest centroid ``[..., N]`` under ``Σ_t w_t (x_t − c_t)²`` for points
    ``x [..., N, d]``, centroids ``[..., K, d]`` and weights broadcastable to ``x``
    (``Σ w c² − 2 Σ w x c``; the ``Σ w x²`` term is the same for every centroid)."""
    N, d = x.shape[-2:]
    x3 = x.reshape(-1, N, d)
    w3 = weight.expand_as(x).reshape(-1, N, d)
    c3 = centroids.reshape(-1, centroids.shape[-2], d).transpose(1, 2)
    dist = torch.baddbmm(w3.bmm(c3.square()), w3 * x3, c3, alpha=-2)
    return dist.argmin(-1).view(x.shape[:-1])


def _fit_codebooks(X: Tensor, col_weight: Tensor, R: int, K: int, d: int, iters: int) -> Tensor:
    """``[E, Gr, K, d]`` weighted k-means codebooks of ``X [E, O, g]`` with column weights
    ``[E, g]`` (module docstring)."""
    pts, w = _codebook_points(X, col_weight, R, d)
    cb = _mahalanobis_init(pts, K)
    assign = None
    wp = w * pts
    for _ in range(iters):
        new = _nearest(pts, cb, w)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        idx = assign.unsqueeze(-1).expand_as(pts)
        num = torch.zeros_like(cb).scatter_add_(-2, idx, wp)  # [.., K, d]
        den = torch.zeros_like(cb).scatter_add_(-2, idx, w)
        cb = torch.where(den > 0, num / den.clamp_min(1e-30), cb)
    return cb


def _mahalanobis_init(pts: Tensor, K: int) -> Tensor:
    """``K`` points of ``pts [.., N, d]`` evenly spaced in the order of their Mahalanobis
    distance from the mean (the authors' ``mahalanobis_init``; a singular covariance uses
    its pseudo-inverse)."""
    centered = pts - pts.mean(-2, keepdim=True)
    cov = centered.transpose(-1, -2).matmul(centered)
    dist = (centered.matmul(torch.linalg.pinv(cov)) * centered).sum(-1)  # [.., N]
    order = dist.argsort(-1)
    pick = torch.linspace(0, pts.shape[-2] - 1, K).round().long()
    idx = order[..., pick]
    return pts.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, pts.shape[-1]))


def _round_codebooks(cb: Tensor) -> tuple[Tensor, Tensor]:
    """Codebooks ``[.., K, d]`` → (int8 coordinates, float16 scale ``[..]``) with
    ``scale = max|c| / 127`` rounded up to float16; the dequantized codebook
    ``scale · int8`` replaces ``cb`` in place."""
    scale = round_scale_up(cb.abs().amax((-1, -2)) / CODEBOOK_QMAX)
    s = scale.float()[..., None, None]
    q = torch.clamp(torch.round(cb / s), -CODEBOOK_QMAX - 1, CODEBOOK_QMAX)
    cb.copy_(q * s)
    return q.to(torch.int8), scale


def _objective(W: Tensor, W_hat: Tensor, G: Tensor) -> Tensor:
    """``[E, O]`` float64 per-row ``(w − ŵ) G (w − ŵ)ᵀ``."""
    D = (W - W_hat).double()
    return (D.bmm(G) * D).sum(-1)


M_STEP_ITERS = 25  # conjugate-gradient steps (the authors take 25 Adam steps)


def _refit_codebooks(vq: VQTensor, W: Tensor, G: Tensor) -> None:
    """The M-step: :func:`_solve_codebooks`, rounded to int8 and kept per row block only
    where the rounded refit lowers the objective. Updates ``vq`` in place."""
    E, _, _ = W.shape
    Gr, R = vq.codebook.shape[1], vq.rows
    before = _objective(W, vq.dequantize(), G).view(E, Gr, R).sum(-1)
    cb_int, scales = _round_codebooks(_solve_codebooks(vq, W, G, M_STEP_ITERS))
    trial = VQTensor(vq.codes, cb_int, scales, vq.bits, vq.vq_dim, R, vq.group_size)
    after = _objective(W, trial.dequantize(), G).view(E, Gr, R).sum(-1)
    better = after < before  # [E, Gr]
    vq.codebook = torch.where(better[..., None, None, None], cb_int, vq.codebook)
    vq.scales = torch.where(better[..., None], scales, vq.scales)


def _solve_codebooks(vq: VQTensor, W: Tensor, G: Tensor, iters: int) -> Tensor:
    """``[E, O/R, I/g, K, d]`` float32 codebook coordinates ``c`` minimising, per expert and
    block of rows, ``Σ_rows (w − ŵ) G (w − ŵ)ᵀ`` with ``vq``'s assignments fixed: the normal
    equations ``(Σ_r P_rᵀ G P_r) c = Σ_r P_rᵀ G w_r`` (``P_r`` maps row ``r``'s weights to
    the coordinates they read) by ``iters`` steps of Jacobi-preconditioned conjugate
    gradients from ``vq``'s codebook, every block at once, without forming the matrix (each
    step one ``Ŵ G`` product; exact after as many steps as a block has coordinates)."""
    E, O, I = W.shape  # noqa: E741
    d, R, g = vq.vq_dim, vq.rows, vq.group_size
    Gr, Gc, K = vq.codebook.shape[1:4]
    n = Gc * K * d
    col = torch.arange(I)
    block = (torch.arange(E).view(E, 1) * Gr + torch.arange(O).view(1, O) // R) * n  # [E, O]
    # the coordinate every weight reads: (block, column group, centroid, dimension)
    coord = ((col // g) * K + vq.codes.repeat_interleave(d, dim=2)) * d + col % d
    coord = (coord + block.unsqueeze(-1)).view(-1)  # [E·O·I]
    Gf = G.float()

    def gather_t(y: Tensor) -> Tensor:  # Σ over the weights reading each coordinate
        return torch.zeros(E * Gr * n).index_add_(0, coord, y.reshape(-1))

    def apply(x: Tensor) -> Tensor:  # (Σ_r P_rᵀ G P_r) x
        return gather_t(x[coord].view(E, O, I).bmm(Gf))

    def dot(a: Tensor, b: Tensor) -> Tensor:  # per block
        return (a * b).view(E * Gr, n).sum(-1).repeat_interleave(n)

    x = (vq.codebook.float() * vq.scales.float()[..., None, None]).reshape(-1)
    b = gather_t(W.float().bmm(Gf))
    precond = gather_t(torch.diagonal(Gf, dim1=1, dim2=2).unsqueeze(1).expand(E, O, I))
    precond = precond.clamp_min(float(precond.max()) * 1e-12 + 1e-30)
    r = b - apply(x)
    z = r / precond
    p, rz = z, dot(r, z)
    for _ in range(iters):
        Ap = apply(p)
        pAp = dot(p, Ap)
        alpha = torch.where(pAp > 0, rz / pAp.clamp_min(1e-30), torch.zeros_like(pAp))
        x = x + alpha * p
        r = r - alpha * Ap
        z = r / precond
        rz_new = dot(r, z)
        p = z + torch.where(rz > 0, rz_new / rz.clamp_min(1e-30), torch.zeros_like(rz)) * p
        rz = rz_new
    return x.view(E, Gr, Gc, K, d)
