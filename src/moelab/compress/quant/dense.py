"""Round-to-nearest quantization of a model's dense projections (every ``nn.Linear``:
attention, dense FFN, latent projections, the LM head), after its experts.

The rule is :func:`~moelab.compress.quant.rtn.quantize_rtn`, symmetric, group-wise along the
input columns: what llama.cpp's Q8_0 does per block of 32 (``quantize_row_q8_0_ref``: step
``max|w| / 127``, one float16 scale per block), here with moelab's symmetric grid (step
``2·max|w| / (2^bits − 1)``, zero point ``2^(bits−1)``) and the experts' group size.
No calibration: every weight is within half a step of its code (8 bits: 1/255 of the group's
range), where GPTQ has little left to recover.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelab.compress.quant.rtn import quantize_rtn
from moelab.errors import InvalidValueError
from moelab.models.quantized_linear import QuantizedLinear, dense_spec
from moelab.models.transformer import MoETransformer


@dataclass
class DenseReport:
    """What :func:`quantize_dense` did (the ``dense`` entry of ``quantize.json``).

    Attributes:
        bits, group_size: the grid.
        modules: quantized module names, in module order.
        weights: their weight count.
        bytes: stored bytes of their codes and scales (biases stay float and are not counted).
        max_abs_error: the largest ``|W − Ŵ|`` over all of them.
    """

    bits: int
    group_size: int
    modules: list[str]
    weights: int
    bytes: int
    max_abs_error: float

    def to_dict(self) -> dict:
        return {
            "bits": self.bits, "group_size": self.group_size, "modules": self.modules,
            "weights": self.weights, "bytes": self.bytes,
            "bits_per_param": 8 * self.bytes / max(self.weights, 1),
            "max_abs_error": self.max_abs_error,
        }  # fmt: skip


def dense_targets(model: MoETransformer, bits: int, group_size: int) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` by name, checked for :func:`quantize_dense`
    (call it before a long calibration to fail early).

    Raises:
        ValueError: unsupported ``bits``, ``group_size`` does not divide a projection's input
            width (naming it), the model has no linear layer, or a weight is not finite.
    """
    dense_spec(bits, group_size)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise InvalidValueError("model: has no dense projection to quantize")
    for name, lin in linears.items():
        if lin.in_features % group_size:
            raise InvalidValueError(
                f"group_size: {group_size} does not divide {name}'s input width {lin.in_features}"
            )
        if not bool(torch.isfinite(lin.weight).all()):
            raise InvalidValueError(f"model: {name} holds NaN or inf weights")
    return linears


@torch.no_grad()
def quantize_dense(model: MoETransformer, bits: int, group_size: int) -> DenseReport:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantizedLinear` of ``bits`` bits
    and ``group_size`` columns per scale (in place). A tied LM head is untied: the embedding
    lookup keeps the float matrix, the head reads the codes.

    Raises:
        ValueError: as :func:`dense_targets` (before anything is replaced).
    """
    linears = dense_targets(model, bits, group_size)
    weights = nbytes = 0
    max_err = 0.0
    for name, lin in linears.items():
        q = quantize_rtn(lin.weight.float(), bits, group_size, symmetric=True)
        new = QuantizedLinear.from_codes(q.codes, q.scales, bits, group_size, lin.bias)
        new = new.to(device=lin.weight.device, dtype=lin.weight.dtype)
        max_err = max(max_err, float((new.weight - lin.weight.float()).abs().max()))
        model.set_submodule(name, new)
        weights += lin.weight.numel()
        nbytes += sum(new.proj.storage_bytes().values())
    return DenseReport(bits, group_size, list(linears), weights, nbytes, max_err)
