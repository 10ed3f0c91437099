"""Grouped matmul over contiguous per-expert row blocks: ``y[rows_e] = x[rows_e] @ w[e]``.

Two backends with one contract:
- ``torch``: ``torch.nn.functional.grouped_mm`` (PyTorch >= 2.9), one kernel for all experts.
- ``loop``: a custom autograd Function that runs one ``torch.mm`` per expert into preallocated
  outputs, forward and backward. Unlike slicing under autograd (whose backward materialises a
  full-size zero gradient per slice, O(E·N·D)), its backward writes each block once.
``"auto"`` picks ``loop`` on CPU (measured by ``benchmarks/layer_speed.py``: the same forward
speed as ``torch``, and a faster backward, since CPU ``grouped_mm``'s backward zero-fills and
multiplies every expert's block even when it received no rows) and ``torch`` on accelerators
when the inputs meet its kernel's requirements (float32/bfloat16, rows 16-byte aligned). Experts that receive no rows are skipped (their
weight gradient is zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_HAS_TORCH_GROUPED_MM = hasattr(F, "grouped_mm")


class _LoopGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        y = x.new_empty(x.shape[0], w.shape[2])
        start = 0
        for e, c in enumerate(counts):
            if c:
                torch.mm(x[start : start + c], w[e], out=y[start : start + c])
                start += c
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, w = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        start = 0
        for e, c in enumerate(ctx.counts):
            if not c:
                if grad_w is not None:
                    grad_w[e].zero_()
                continue
            rows = slice(start, start + c)
            if grad_x is not None:
                torch.mm(grad_y[rows], w[e].t(), out=grad_x[rows])
            if grad_w is not None:
                torch.mm(x[rows].t(), grad_y[rows], out=grad_w[e])
            start += c
        return grad_x, grad_w, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (CPU grouped_mm's
    backward rejects expanded gradients such as the one ``y.sum().backward()`` produces)."""

    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _torch_supported(x: Tensor, w: Tensor) -> bool:
    if not _HAS_TORCH_GROUPED_MM or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, backend: str = "auto") -> Tensor:
    """Per-expert matmul over sorted rows.

    Args:
        x: ``[N, I]`` rows sorted by expert (expert 0's rows first).
        w: ``[E, I, O]`` stacked expert weights, same dtype as x.
        counts: ``[E]`` int64 rows per expert, ``counts.sum() == N``.
        backend: ``"auto"``, ``"torch"`` or ``"loop"``.
    Returns:
        ``[N, O]`` with ``y[rows_e] = x[rows_e] @ w[e]``.
    """
    if backend == "auto":
        backend = "torch" if x.device.type != "cpu" and _torch_supported(x, w) else "loop"
    if backend == "torch":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offs))
    if backend == "loop":
        return _LoopGroupedMM.apply(x, w, counts.tolist())
    raise ValueError(f"backend: must be auto, torch or loop, got {backend!r}")
