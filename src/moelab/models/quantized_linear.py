"""Weight-only quantized dense projections: attention, dense FFN, latent projections and the
LM head held as integer codes.

``moelab quantize`` quantizes the routed experts; the model's other matrices stay in float.
At batch-1 decode on a CPU every matrix is read once per token, so on a model whose experts
are quantized the float dense projections become a large share of the bytes read (on the
SmolLM2-MoE upcycle: 30 layers of attention, 26 M weights, and the 28 M-weight LM head
against 159 M active expert weights). llama.cpp's Q8_0 files quantize every matrix but the
routers for the same reason (``llama-quant.cpp`` skips ``ffn_gate_inp``); ``moelab quantize
--dense-bits`` does the same with :class:`QuantizedLinear`.

A :class:`QuantizedLinear` holds its matrix ``W [O, I]`` as a one-expert
:class:`~moelab.core.experts.quantized.QuantizedProjection` (the experts' format:
:mod:`moelab.core.experts.qformat`): symmetric round-to-nearest codes, one float16 scale per
output row and group of input columns. Inputs of at most
:data:`~moelab.core.experts.quantized.KERNEL_MAX_ROWS` rows (decode, and prefill of a few
hundred tokens) run through the experts' compiled kernel, which reads the packed codes once
per 8 rows (with int8 activations where the CPU has AVX-512 VNNI, as llama.cpp's quantized
matmuls do); larger inputs, other dtypes and training dequantize the matrix and multiply in
float.

The routers are never quantized: they are parameters of the MoE layer, not ``nn.Linear``
modules, and rounding their logits would move the routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.experts.quantized import (
    KERNEL_MAX_ROWS,
    QuantizedProjection,
    QuantSpec,
    kernel_applies,
)


def dense_spec(bits: int, group_size: int) -> QuantSpec:
    """The :class:`QuantSpec` of quantized dense projections: RTN, symmetric, no low rank.

    Raises:
        ValueError: unsupported ``bits`` or a ``group_size`` below 1.
    """
    return QuantSpec(method="rtn", bits=bits, group_size=group_size, symmetric=True)


class QuantizedLinear(nn.Module):
    """``y = x Ŵᵀ + b`` with ``Ŵ [O, I]`` stored as packed codes and float16 group scales.

    Args:
        in_features, out_features: ``I`` and ``O``.
        bias: keep a float bias ``[O]`` (``nn.Linear``'s, unquantized).
        bits: 2, 3, 4 or 8 (the kernel takes 4 and 8; others always dequantize).
        group_size: input columns per scale; must divide ``I``.
    Buffers ``proj.codes`` / ``proj.scales`` (see :class:`QuantizedProjection`, one expert);
    fill them with ``load_state_dict`` or build the module with :meth:`from_codes`.
    Raises:
        ValueError: ``group_size`` does not divide ``I``, or unsupported ``bits``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.proj = QuantizedProjection(1, out_features, in_features, dense_spec(bits, group_size))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_codes(
        cls, codes: Tensor, scales: Tensor, bits: int, group_size: int, bias: Tensor | None
    ) -> QuantizedLinear:
        """From ``codes [O, I]`` (ints in ``[0, 2^bits − 1]``, zero point ``2^(bits−1)``),
        ``scales [O, I / group_size]`` and an optional float ``bias [O]``.

        Raises:
            ValueError: shapes that disagree, or a scale beyond float16's range.
        """
        O, I = codes.shape  # noqa: E741
        q = cls(I, O, bias is not None, bits, group_size)
        q.proj = QuantizedProjection.from_codes(
            q.proj.spec, codes[None], scales[None], None, None, None
        )
        if bias is not None:
            q.bias = nn.Parameter(bias.detach().clone())
        return q

    @property
    def spec(self) -> QuantSpec:
        return self.proj.spec

    @property
    def weight(self) -> Tensor:
        """``[O, I]`` float32 dequantized weights (computed; for readers of ``.weight``)."""
        return self.proj.dequantize(torch.float32)[0]

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., I]`` → ``[..., O]`` in ``x``'s dtype.

        Raises:
            RuntimeError: the last dimension of ``x`` is not ``I``.
        """
        if x.shape[-1] != self.in_features:
            raise RuntimeError(
                f"x: last dimension {x.shape[-1]}, this projection takes {self.in_features}"
            )
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        if 0 < n <= KERNEL_MAX_ROWS and kernel_applies(self.proj.spec, rows):
            y = self.proj.kernel_mm(rows, torch.tensor([n]))
        else:
            y = F.linear(rows, self.proj.dequantize(x.dtype)[0])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, bits={s.bits}, group_size={s.group_size}"
        )
