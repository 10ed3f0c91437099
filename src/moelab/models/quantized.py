"""Quantized model folders: an ordinary model folder whose MoE expert banks are
:class:`~moelab.core.experts.quantized.QuantizedExpertBank` s.

Layout (same files and checksum manifest as :mod:`moelab.models.io`)::

    config.json        {"format_version": 1, "model": {...},
                        "quantization": {"format_version": 2, "spec": QuantSpec.to_dict()}}
    model.safetensors  non-expert weights as usual; per MoE layer and projection
                       ``blocks.{i}.ffn.experts.projections.{gate,up,down}.{codes,scales,
                       zeros,g_idx,perm}`` and ``...lowrank.{U,V,S,in_scale,row_of,
                       col_of}`` (factors float16, scales float16 bit patterns as int16,
                       codes/zeros bit-packed uint8, perm int16 for rotated GPTQ);
                       metadata {"format_version": "1", "quantization_format_version": "2"}
    manifest.json      sha256 + size of every file

:func:`moelab.models.io.load_model` reads such a folder like any other (it calls
:func:`quantized_structure` before loading the state dict), so a quantized folder evaluates,
analyses and generates like any run.
"""

from __future__ import annotations

from typing import Any

from moelab.core.experts.quantized import QuantizedExpertBank, QuantSpec
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models.transformer import MoETransformer

QUANT_FORMAT_VERSION = 2  # 2: ``tileq`` is the authors'-code form; version 1's is ``tileq-core``


def is_quantized(model: MoETransformer) -> bool:
    """True when any MoE layer of ``model`` holds a quantized expert bank."""
    return any(
        isinstance(m, MoELayer) and isinstance(m.experts, QuantizedExpertBank)
        for m in model.modules()
    )


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


def quantized_structure(model: MoETransformer, spec: QuantSpec) -> MoETransformer:
    """Replace every MoE layer's expert bank by an empty quantized bank of ``spec`` (in
    place; fill it with ``load_state_dict``). Returns ``model``.

    Raises:
        ValueError: the spec does not fit the model (group size, rank, grid).
    """
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
        return None
    return {"format_version": QUANT_FORMAT_VERSION, "spec": spec.to_dict()}


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
    try:
        return QuantSpec.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise InvalidValueError(f"{where}: invalid quantization spec ({e})") from e
