"""``Linear``: the LM's dense projections, with decode steps on the streaming CPU kernel.

At a decode step an ``nn.Linear`` multiplies 1-8 rows by its weight, and MKL then reads the
weight at a fraction of the memory bandwidth; in a float32 SmolLM2-sized model the attention
projections and the 28 M-weight LM head are a third of a decode step's bytes. ``Linear``
sends such calls to :func:`moelab.core.experts.cpu_kernel.dense_rows` and every other call
(training, prefill, GPUs, other dtypes, autocast) to ``F.linear``: same parameters, state
dict and maths as ``nn.Linear``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.experts import cpu_kernel


class Linear(nn.Linear):
    """``nn.Linear`` (``y = x Wᵀ + b``, ``W [out, in]``) whose inference calls of at most
    :data:`~moelab.core.experts.cpu_kernel.DENSE_MAX_ROWS` float32 CPU rows run the streaming
    kernel (:func:`~moelab.core.experts.cpu_kernel.dense_rows_apply` says when). Shapes:
    ``x [..., in]`` → ``[..., out]``."""

    def forward(self, x: Tensor) -> Tensor:
        if cpu_kernel.dense_rows_apply(x, self.weight, self.bias):
            return cpu_kernel.dense_rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
