"""Bottleneck adapters beside a module (AdaptFormer, APER, CaRE).

:class:`ParallelAdapter`: ``a(h) = s ⊙ up(dropout(relu(down(LN(h)))))`` with
``down: D → d`` and ``up: d → D`` (Chen et al., "AdaptFormer", NeurIPS 2022, arXiv 2205.13535,
Eq. 1–2; APER reuses it; CaRE's experts are such adapters with the LayerNorm first,
``adapter_layernorm_option="in"``, ``wave3-continual.md`` §1.1). The LayerNorm is optional;
the scale s is a fixed float, a learnable scalar or a learnable per-channel vector (CaRE),
initialised to ``scale``. Init as AdaptFormer's ``"lora"`` option: ``down`` Kaiming-uniform
(a = √5), ``up`` and both biases zero, so a fresh adapter adds exact zeros.

:class:`ParallelAdapterWrapper` puts an adapter beside a module ``m``:

- ``source="input"`` (parallel, AdaptFormer): ``out = m(h, ...) + a(h)`` where ``h`` is
  ``m``'s first positional argument. AdaptFormer's and CaRE's placement needs an ``m`` whose
  input is the residual stream it adds to: in moelab's pre-norm :class:`DecoderBlock` the FFN
  receives ``ffn_norm(h)``, so wrapping ``blocks.i.ffn`` gives the adapter the normalised
  stream; wrapping ``blocks.i`` gives it the block input (an adapter parallel to the block).
- ``source="output"`` (sequential, Houlsby-style): ``out = m(h) + a(m(h))``.

In both, ``a`` is added to ``m``'s primary output: the tensor itself, the first item of a
tuple (HF blocks, :class:`DecoderBlock`), or the ``hidden_states`` field of a dataclass
(:class:`moelab.core.layer.MoEOutput`); every other field is passed through. Attributes the
wrapper lacks are looked up on ``m`` (``layer.router`` keeps working), as PEFT's wrappers do.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.lora import lora_uniform_

LEARNABLE_SCALES = (None, "scalar", "channel")
SOURCES = ("input", "output")


class ParallelAdapter(nn.Module):
    """A bottleneck adapter ``[..., D] → [..., D]`` (formula in the module docstring).

    Args:
        dim: D.
        bottleneck: d >= 1.
        scale: s (the initial value when learnable).
        learnable_scale: None (fixed float), ``"scalar"`` or ``"channel"`` (``[D]``).
        layer_norm: a LayerNorm(D) on the adapter input first.
        dropout: dropout probability after the ReLU.
    Raises:
        InvalidValueError: dim or bottleneck < 1, an unknown ``learnable_scale``, dropout
            outside [0, 1).
    """

    def __init__(
        self,
        dim: int,
        bottleneck: int,
        scale: float = 0.1,
        learnable_scale: str | None = None,
        layer_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, v in (("dim", dim), ("bottleneck", bottleneck)):
            if not isinstance(v, int) or v < 1:
                raise InvalidValueError(f"{name}: must be an int >= 1, got {v!r}")
        if learnable_scale not in LEARNABLE_SCALES:
            raise InvalidValueError(
                f"learnable_scale: must be one of {LEARNABLE_SCALES}, got {learnable_scale!r}"
            )
        if not 0 <= dropout < 1:
            raise InvalidValueError(f"dropout: must be in [0, 1), got {dropout!r}")
        self.norm = nn.LayerNorm(dim) if layer_norm else nn.Identity()
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        with torch.no_grad():
            lora_uniform_(self.down.weight)
            self.down.bias.zero_()
            self.up.weight.zero_()
            self.up.bias.zero_()
        if learnable_scale is None:
            self.scale: float | nn.Parameter = float(scale)
        else:
            shape = (1,) if learnable_scale == "scalar" else (dim,)
            self.scale = nn.Parameter(torch.full(shape, float(scale)))

    def forward(self, h: Tensor) -> Tensor:
        a = self.up(self.dropout(torch.relu(self.down(self.norm(h)))))
        return a * self.scale


def _primary(out) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if dataclasses.is_dataclass(out) and isinstance(getattr(out, "hidden_states", None), Tensor):
        return out.hidden_states
    raise InvalidTypeError(
        f"module output: a {type(out).__name__} has no primary tensor to add an adapter to "
        "(expected a tensor, a tuple starting with one, or a dataclass with hidden_states)"
    )


def _add(out, delta: Tensor):
    if isinstance(out, Tensor):
        return out + delta.to(out.dtype)
    if isinstance(out, (tuple, list)):
        return type(out)([out[0] + delta.to(out[0].dtype), *out[1:]])
    h = out.hidden_states
    return dataclasses.replace(out, hidden_states=h + delta.to(h.dtype))


class ParallelAdapterWrapper(nn.Module):
    """``module`` with ``adapter`` beside it (``source`` as in the module docstring).

    Raises:
        InvalidValueError: an unknown ``source``.
        InvalidTypeError: at forward, ``source="input"`` without a tensor first argument,
            or an output with no primary tensor.
    """

    def __init__(self, module: nn.Module, adapter: nn.Module, source: str = "input") -> None:
        super().__init__()
        if source not in SOURCES:
            raise InvalidValueError(f"source: must be one of {SOURCES}, got {source!r}")
        self.module = module
        self.adapter = adapter
        self.source = source

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        h = _primary(out)  # also refuses outputs the adapter cannot be added to
        if self.source == "input":
            if not args or not isinstance(args[0], Tensor):
                raise InvalidTypeError(
                    "source='input': the module's first argument is not a tensor"
                )
            h = args[0]
        return _add(out, self.adapter(h))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def extra_repr(self) -> str:
        return f"source={self.source!r}"
