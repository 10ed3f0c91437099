"""Quantized model folders: an ordinary model folder whose MoE expert banks are
:class:`~moelab.core.experts.quantized.QuantizedExpertBank` s, and optionally whose dense
projections are :class:`~moelab.models.quantized_linear.QuantizedLinear` s.

Layout (same files and checksum manifest as :mod:`moelab.models.io`)::

    config.json        {"format_version": 1, "model": {...},
                        "quantization": {"format_version": 2, "spec": QuantSpec.to_dict()}}
                       with quantized dense projections: format_version 3 and
                       "dense": {"bits": b, "group_size": g, "modules": [names]};
                       GPTVQ experts (codebooks): format_version 4
    model.safetensors  non-expert weights as usual; per MoE layer and projection
                       ``blocks.{i}.ffn.experts.projections.{gate,up,down}.{codes,scales,
                       zeros,g_idx,perm,codebook}`` and ``...lowrank.{U,V,S,in_scale,row_of,
                       col_of}`` (factors float16, scales float16 bit patterns as int16,
                       codes/zeros bit-packed uint8, perm int16 for rotated GPTQ, codebook
                       int8 for GPTVQ);
                       metadata {"format_version": "1", "quantization_format_version": "2"};
                       a quantized dense projection ``name`` stores ``name.proj.codes``,
                       ``name.proj.scales`` (one expert) and ``name.bias`` if it has one
    manifest.json      sha256 + size of every file

:func:`moelab.models.io.load_model` reads such a folder like any other (it calls
:func:`quantized_structure` before loading the state dict), so a quantized folder evaluates,
analyses and generates like any run.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moelab.core.experts.quantized import QuantizedExpertBank, QuantSpec
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models.quantized_linear import QuantizedLinear, dense_spec
from moelab.models.transformer import MoETransformer

# 2: ``tileq`` is the authors'-code form; version 1's is ``tileq-core``. 3: a "dense" entry
# (quantized dense projections). 4: GPTVQ experts (centroid indices and int8 codebooks). Each
# folder is written with the lowest version that holds it, so a moelab that reads 2 keeps
# reading the folders it could always read.
VQ_FORMAT_VERSION = 4
QUANT_FORMAT_VERSION = VQ_FORMAT_VERSION


def is_quantized(model: MoETransformer) -> bool:
    """True when any MoE layer of ``model`` holds a quantized expert bank, or any dense
    projection is quantized."""
    return any(
        (isinstance(m, MoELayer) and isinstance(m.experts, QuantizedExpertBank))
        or isinstance(m, QuantizedLinear)
        for m in model.modules()
    )


def quantized_dense(model: MoETransformer) -> dict[str, QuantizedLinear]:
    """The quantized dense projections of ``model`` by module name (module order)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def model_quant_spec(model: MoETransformer) -> QuantSpec | None:
    """The :class:`QuantSpec` shared by the model's quantized banks (None if not quantized).

    Raises:
        ValueError: banks quantized with different specs, or a mix of quantized and
            full-precision banks (not a format this version stores).
    """
    specs = {
        m.experts.spec if isinstance(m.experts, QuantizedExpertBank) else None
        for m in model.modules()
        if isinstance(m, MoELayer)
    }
    if specs == {None} or not specs:
        return None
    if len(specs) != 1 or None in specs:
        raise InvalidValueError("model: MoE layers are quantized with different settings")
    return next(iter(specs))


def quantized_structure(
    model: MoETransformer, spec: QuantSpec, dense: dict[str, Any] | None = None
) -> MoETransformer:
    """Replace every MoE layer's expert bank by an empty quantized bank of ``spec``, and the
    ``nn.Linear`` modules that ``dense`` (a :func:`read_dense` result) names by empty
    :class:`QuantizedLinear` s (in place; fill them with ``load_state_dict``). Returns
    ``model``. A tied LM head that is quantized is untied: the embedding stays in float.

    Raises:
        ValueError: the spec does not fit the model (group size, rank, grid), or ``dense``
            names a module that is not an ``nn.Linear`` of the model.
    """
    for name in dense["modules"] if dense is not None else ():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            raise InvalidValueError(f"quantization: dense module {name!r} is not a linear layer")
        q = QuantizedLinear(
            linear.in_features, linear.out_features, linear.bias is not None, dense["bits"],
            dense["group_size"],
        )  # fmt: skip
        model.set_submodule(name, q.to(device=linear.weight.device, dtype=linear.weight.dtype))
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            ex = layer.config.experts
            E = layer.config.router.num_experts
            spec.check_model(E, (ex.hidden_size, ex.ffn_hidden_size))
            bank = QuantizedExpertBank.empty(ex, E, spec)
            ref = layer.experts.w_down
            layer.experts = bank.to(device=ref.device, dtype=ref.dtype)
    return model


def quantization_section(model: MoETransformer) -> dict[str, Any] | None:
    """The ``"quantization"`` entry of config.json for ``model`` (None when not quantized)."""
    spec = model_quant_spec(model)
    if spec is None:
        if quantized_dense(model):
            raise InvalidValueError(
                "model: dense projections are quantized but the experts are not (a format "
                "this version does not store)"
            )
        return None
    dense = quantized_dense(model)
    if not dense:
        return {"format_version": VQ_FORMAT_VERSION if spec.vector else 2, "spec": spec.to_dict()}
    specs = {m.spec for m in dense.values()}
    if len(specs) != 1:
        raise InvalidValueError("model: dense projections are quantized with different settings")
    d = next(iter(specs))
    return {
        "format_version": VQ_FORMAT_VERSION if spec.vector else 3,
        "spec": spec.to_dict(),
        "dense": {"bits": d.bits, "group_size": d.group_size, "modules": list(dense)},
    }


def read_dense(section: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The ``"dense"`` entry of a parsed ``"quantization"`` section (None when absent):
    ``{"bits", "group_size", "modules"}``.

    Raises:
        ValueError: malformed (the message starts with ``where``).
    """
    dense = section.get("dense")
    if dense is None:
        return None
    ok = (
        isinstance(dense, dict)
        and set(dense) == {"bits", "group_size", "modules"}
        and isinstance(dense["modules"], list)
        and all(isinstance(m, str) and m for m in dense["modules"])
        and all(isinstance(dense[k], int) and not isinstance(dense[k], bool)
                for k in ("bits", "group_size"))
    )  # fmt: skip
    if not ok:
        raise InvalidValueError(f"{where}: malformed 'dense' entry of the quantization section")
    try:
        dense_spec(dense["bits"], dense["group_size"])
    except ValueError as e:
        raise InvalidValueError(f"{where}: invalid dense quantization ({e})") from e
    return dense


def read_quantization(section: Any, where: str) -> QuantSpec:
    """Parse a config.json ``"quantization"`` section.

    Raises:
        ValueError: malformed, newer format version, or an invalid spec (the message starts
            with ``where``).
    """
    if not isinstance(section, dict) or not isinstance(section.get("spec"), dict):
        raise InvalidValueError(f"{where}: malformed 'quantization' section")
    v = section.get("format_version")
    if not isinstance(v, int) or not 1 <= v <= QUANT_FORMAT_VERSION:
        raise InvalidValueError(
            f"{where}: quantization format_version {v!r} is not one this moelab reads "
            f"(1..{QUANT_FORMAT_VERSION})"
        )
    spec = dict(section["spec"])
    if v == 1 and spec.get("lowrank") == "tileq":  # version 1's tileq had r x r cores
        spec["lowrank"] = "tileq-core"
    if v < VQ_FORMAT_VERSION and spec.get("method") == "gptvq":
        raise InvalidValueError(f"{where}: GPTVQ codebooks need quantization format_version 4")
    try:
        return QuantSpec.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise InvalidValueError(f"{where}: invalid quantization spec ({e})") from e
