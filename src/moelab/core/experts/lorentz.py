"""Lorentz-model (hyperboloid) operations with a curvature tensor ``k``, on top of geoopt.

Convention (geoopt's): a point ``x = (x_0, x_s)`` of the hyperboloid of parameter ``k > 0``
satisfies ``⟨x, x⟩_L = −x_0² + ‖x_s‖² = −k``, ``x_0 > 0``; its sectional curvature is
``K = −1/k``. ``k`` is a 0-d tensor (possibly learnable: every operation here is differentiable
in it). Shapes: ``[..., D+1]``, the time coordinate first. Run them in float64, as the authors'
code does; float32 loses the constraint for points far from the origin.

Sources: the authors' code of EEG-MoCE (Zhou et al., "EEG-Based Multimodal Learning via
Hyperbolic Mixture-of-Curvature Experts", ICML 2026, arXiv 2604.12579; zhourunhe/EEG-MoCE,
``lib/lorentz/manifold.py``, ``nets/HMultimodalNet.py``), whose pieces come from
Bdeir et al., "Fully Hyperbolic Convolutional Neural Networks for Computer Vision" (ICLR 2024:
centroid, Lorentz activation, direct-concatenation flatten after Qu et al. 2022, MLR) and
Law et al. 2019 (the closed-form weighted Lorentz centroid). The exp-map radius clamp is the
authors' vendored geoopt (``EXP_MAX_NORM = 10``), which upstream geoopt does not have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.errors import InvalidValueError, MissingDependencyError

EXP_MAX_NORM = 10.0
"""Radius clamp of the authors' vendored geoopt's ``expmap0``: tangent vectors longer than
this are shortened to it before the map, so no point lies further than 10 from the origin."""

GEOOPT_INSTALL = 'pip install "moelab[science]"  (or: pip install "geoopt>=0.5")'


def geoopt_lorentz(k: float, learnable: bool, dtype: torch.dtype = torch.float64):
    """A ``geoopt.Lorentz`` manifold module with parameter ``k`` (its ``.k`` is an
    ``nn.Parameter`` of ``dtype``, trainable iff ``learnable``).

    Raises:
        InvalidValueError: ``k`` is not a finite number > 0.
        MissingDependencyError: geoopt is not installed (names the install command).
    """
    if not (isinstance(k, (int, float)) and 0 < k < float("inf")):
        raise InvalidValueError(f"k: the Lorentz parameter must be a finite number > 0, got {k!r}")
    try:
        import geoopt
    except ImportError:
        raise MissingDependencyError(
            f"hyperbolic experts need geoopt; install it with: {GEOOPT_INSTALL}"
        ) from None
    # geoopt stores k in the default dtype; cast, or fp64 inputs meet a fp32 k
    return geoopt.Lorentz(k=k, learnable=learnable).to(dtype)


def minkowski_inner(x: Tensor, y: Tensor) -> Tensor:
    """``⟨x, y⟩_L = −x_0 y_0 + ⟨x_s, y_s⟩`` over the last axis: ``[..., D+1] → [...]``."""
    xy = x * y
    return xy[..., 1:].sum(-1) - xy[..., 0]


def pairwise_inner(x: Tensor, y: Tensor) -> Tensor:
    """``⟨x_i, y_j⟩_L`` for every pair: ``[..., N, D+1] × [..., M, D+1] → [..., N, M]``."""
    return x[..., 1:] @ y[..., 1:].transpose(-1, -2) - x[..., :1] @ y[..., :1].transpose(-1, -2)


def add_time(space: Tensor, k: Tensor) -> Tensor:
    """The point whose space part is ``space``: ``[..., D] → [..., D+1]`` with
    ``x_0 = √(‖space‖² + k)``."""
    return torch.cat([((space * space).sum(-1, keepdim=True) + k).sqrt(), space], dim=-1)


def midpoint(x: Tensor, k: Tensor, weights: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """Weighted Lorentz centroid ``√k · a / √|⟨a, a⟩_L|`` with ``a = Σ_n w_n x_n``.

    Law et al. 2019's closed form (the authors' ``mid_point``/``centroid``): the point
    minimising the weighted sum of squared Lorentzian distances. Scale-free in ``w``.

    Args:
        x: ``[..., N, D+1]`` points on the manifold of ``k``.
        weights: ``[..., M, N]`` non-negative (M midpoints), or None (one equal-weight
            midpoint, the output then ``[..., D+1]``).
    Returns:
        ``[..., M, D+1]`` (or ``[..., D+1]``) on the manifold of ``k``.
    """
    avg = x.mean(-2) if weights is None else weights @ x
    norm = (-minkowski_inner(avg, avg)).abs().clamp_min(eps).sqrt().unsqueeze(-1)
    return k.sqrt() * avg / norm


def lorentz_elu(x: Tensor, k: Tensor) -> Tensor:
    """ELU on the space part, time recomputed (Bdeir et al.'s Lorentz activation)."""
    return add_time(F.elu(x[..., 1:]), k)


def centroid_pool(x: Tensor, k: Tensor, window: int) -> Tensor:
    """Lorentz average pooling along the sequence: the centroid of each ``window`` steps
    (stride ``window``; a ragged tail is dropped, as ``AvgPool2d`` does).

    ``[B, S, D+1] → [B, S // window, D+1]``.

    Raises:
        InvalidValueError: ``window`` is not in ``[1, S]``.
    """
    B, S, D1 = x.shape
    if not 1 <= window <= S:
        raise InvalidValueError(f"window: must be in [1, {S}] (sequence length), got {window}")
    n = S // window
    return midpoint(x[:, : n * window].reshape(B, n, window, D1), k)


def lorentz_flatten(x: Tensor, k: Tensor) -> Tensor:
    """Lorentz direct concatenation (Qu et al. 2022): concatenate the space parts, time
    ``√(Σ_i x_{i,0}² − (S−1)·k)``; ``[B, S, D+1] → [B, 1 + S·D]``, on the same manifold."""
    B, S, _ = x.shape
    time = ((x[..., 0] ** 2).sum(-1, keepdim=True) - (S - 1) * k).sqrt()
    return torch.cat([time, x[..., 1:].reshape(B, -1)], dim=-1)


def expmap0(v: Tensor, manifold, max_radius: float | None = EXP_MAX_NORM) -> Tensor:
    """geoopt's ``expmap0`` with the authors' radius clamp.

    Args:
        v: ``[..., D+1]`` tangent vectors at the origin (time coordinate 0).
        manifold: a ``geoopt.Lorentz``.
        max_radius: tangent vectors longer than this are shortened to it first (the vendored
            geoopt's ``EXP_MAX_NORM``); None: no clamp (upstream geoopt).
    Returns:
        ``[..., D+1]`` points at geodesic distance ``min(‖v‖, max_radius)`` from the origin.
    """
    if max_radius is not None:
        norm = v[..., 1:].norm(dim=-1, keepdim=True)
        v = v * (max_radius / norm.clamp_min(max_radius))
    return manifold.expmap0(v)


def project_curvature(x: Tensor, source, target, max_radius: float | None = EXP_MAX_NORM) -> Tensor:
    """Move points from one Lorentz manifold to another: ``exp0_t(log0_s(x)·√(k_t/k_s))``.

    The authors' ``project_to_unified_curvature``: the tangent vector at the origin is rescaled
    so that geodesic distances scale by ``√(k_t/k_s)``; gradient reaches ``k_s`` (and ``k_t``
    if it requires grad). Points are returned as they are when the two ``k`` are equal, as the
    code does (so the clamp then does not apply).

    Args:
        x: ``[..., D+1]`` points on ``source``.
        source, target: ``geoopt.Lorentz`` manifolds.
        max_radius: the exp-map clamp (:func:`expmap0`).
    """
    if bool(source.k == target.k):
        return x
    v = source.logmap0(x) * (target.k / source.k).sqrt()
    return expmap0(v, target, max_radius)


def harmonic_mean_k(ks: list[Tensor]) -> Tensor:
    """The fusion manifold's ``k``: the ``k`` whose curvature ``−1/k`` is the mean of the
    modalities' curvatures, i.e. the harmonic mean of the ``k_m``; detached (the authors
    write it into a non-learnable parameter under ``no_grad`` on every forward)."""
    with torch.no_grad():
        return 1.0 / torch.stack([1.0 / k for k in ks]).mean()
