"""The partial block-Hadamard rotation with a column permutation that the TileQ/LoPRo authors
apply to the residual before GPTQ (``fasterquant_rot_new_perm_split`` in
``gptq_utils_lora.py`` and ``block_diagonal_walsh_matrix`` / ``create_diagI_matrix_upper`` /
``construct_partial_permutation_matrix_upper`` in ``hadamard_utils.py``, grysgreat/Sketch_lopro
[K]).

Per expert the rotation is ``R_e = P_e · D`` ``[I, I]``, orthogonal:

- ``P_e`` permutes the columns: column ``j`` of ``X P_e`` is column ``perm_e[j]`` of ``X``;
- ``D = blockdiag(I_{identity}, H_b, …, H_b)``: the first ``identity`` permuted columns are left
  as they are, the others are rotated by normalised Sylvester–Walsh–Hadamard blocks of size
  ``b``.

The quantizer sees ``X R_e``; the stored codes live in that basis, and the effective weight is
``Q R_eᵀ`` (:func:`unrotate`). Choice [I]: ``identity = b`` (the code's defaults are
``id_bsize = ha_bsize = 256``, wider than this project's experts).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


@functools.lru_cache(maxsize=8)
def _walsh(b: int) -> Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < b:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / H.shape[0] ** 0.5


def check_rotation(block: int, width: int) -> None:
    """Raise ``ValueError`` unless ``block`` is a power of two ``>= 2`` dividing ``width``."""
    if block < 2 or block & (block - 1) or width % block:
        raise InvalidValueError(
            f"rotate_block: must be a power of two >= 2 dividing the width {width}, got {block}"
        )


def _rotate_blocks(X: Tensor, block: int, transpose: bool) -> Tensor:
    """``X D`` (or ``X Dᵀ``) for ``X [.., I]``: Walsh blocks after the first ``block``
    columns."""
    I = X.shape[-1]  # noqa: E741
    H = _walsh(block).to(X.dtype).to(X.device)
    if transpose:
        H = H.T
    head, tail = X[..., :block], X[..., block:]
    tail = (tail.reshape(*tail.shape[:-1], (I - block) // block, block) @ H).reshape(tail.shape)
    return torch.cat([head, tail], -1)


def rotate(X: Tensor, perm: Tensor, block: int) -> Tensor:
    """``X_e R_e`` for ``X [E, O, I]`` and ``perm [E, I]`` int (each row a permutation)."""
    idx = perm.long().unsqueeze(1).expand(X.shape)
    return _rotate_blocks(torch.gather(X, -1, idx), block, transpose=False)


def unrotate(X: Tensor, perm: Tensor, block: int) -> Tensor:
    """``X_e R_eᵀ`` for ``X [E, O, I]`` (the inverse of :func:`rotate`)."""
    Y = _rotate_blocks(X, block, transpose=True)
    idx = perm.long().unsqueeze(1).expand(Y.shape)
    return torch.empty_like(Y).scatter_(-1, idx, Y)


def rotate_hessian(H: Tensor, perm: Tensor, block: int) -> Tensor:
    """``R_eᵀ H_e R_e`` for ``H [E, I, I]``."""
    HR = rotate(H, perm, block)  # H R
    return rotate(HR.transpose(1, 2), perm, block)  # (Rᵀ H R)ᵀ = Rᵀ H R (H symmetric)
