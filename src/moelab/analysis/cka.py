"""Linear Centered Kernel Alignment (CKA) between two sets of representations of the same inputs.

Kornblith et al., "Similarity of Neural Network Representations Revisited" (ICML 2019,
arXiv 1905.00414), Eq. 5: with the columns of ``X [n, p]`` and ``Y [n, q]`` centred (each
feature's mean over the ``n`` inputs subtracted),

    CKA(X, Y) = ‖YᵀX‖_F² / (‖XᵀX‖_F · ‖YᵀY‖_F)

in ``[0, 1]``; 1 for ``Y = X``, invariant to orthogonal transforms and isotropic scaling of
either side, not to arbitrary invertible linear maps. Differentiable (the CKA-regularised replay
of selective upcycling backpropagates through it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def linear_cka(x: Tensor, y: Tensor, eps: float = 1e-12) -> Tensor:
    """Linear CKA of ``x [n, p]`` and ``y [n, q]`` (rows: the same n inputs), a float32 scalar
    in ``[0, 1]``.

    Args:
        eps: added to the denominator, so constant features (zero after centring) give 0,
            not NaN.
    Raises:
        InvalidValueError: not 2-D, different row counts, or fewer than 2 rows.
    """
    if x.dim() != 2 or y.dim() != 2:
        raise InvalidValueError(
            f"x, y: expected [n, p] and [n, q] matrices, got {tuple(x.shape)}, {tuple(y.shape)}"
        )
    if x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise InvalidValueError(
            f"x, y: need the same n >= 2 rows, got {x.shape[0]} and {y.shape[0]}"
        )
    x = x.float() - x.float().mean(0, keepdim=True)
    y = y.float() - y.float().mean(0, keepdim=True)
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    norm_x = torch.linalg.matrix_norm(x.T @ x)
    norm_y = torch.linalg.matrix_norm(y.T @ y)
    return cross / (norm_x * norm_y + eps)


def layer_cka(before: list[Tensor], after: list[Tensor]) -> list[float]:
    """Per-layer CKA curve: ``[linear_cka(before[l], after[l]) for each layer l]`` (each
    ``[n, D_l]``, the same n inputs through the model before and after a change).

    Raises:
        InvalidValueError: lists of different lengths, or see :func:`linear_cka`.
    """
    if len(before) != len(after):
        raise InvalidValueError(f"before, after: {len(before)} and {len(after)} layers")
    with torch.no_grad():
        return [float(linear_cka(b, a)) for b, a in zip(before, after, strict=True)]
