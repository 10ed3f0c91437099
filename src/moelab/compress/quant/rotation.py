"""Choosing the column permutation of TileQ's rotated GPTQ (the rotation itself is
:mod:`moelab.core.experts.rotation`).

The code [K] (``fasterquant_rot_new_perm_split``, grysgreat/Sketch_lopro
``gptq_utils_lora.py``) scores every input column of the residual ``res = W − L`` by
``mean_o |res_{o,j}| / (log2 H_jj − min_j log2 H_jj + 1)`` (dead columns, ``H_jj = 0``, get
``H_jj = 1`` first) and orders the columns by increasing score (``topk(−score)``): the
low-score columns come first and are left unrotated, the rest are Walsh-rotated.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotation_permutation(res: Tensor, H: Tensor) -> Tensor:
    """``[E, I]`` int64 column order for ``res [E, O, I]`` and Hessians ``H [E, I, I]``
    (stable sort [I]; the code's ``topk`` leaves ties unordered)."""
    d = torch.diagonal(H.double(), dim1=-2, dim2=-1).clone()
    d[d <= 0] = 1.0
    lg = torch.log2(d)
    score = res.double().abs().mean(1) / (lg - lg.min(-1, keepdim=True).values + 1)
    return torch.sort(score, dim=-1, stable=True).indices
