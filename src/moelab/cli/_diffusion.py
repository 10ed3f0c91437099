"""Options shared by ``moelab generate`` and ``moelab serve`` for block-diffusion models
(``--decoder vanilla|cache|cache+limit|team --threshold τ``)."""

from __future__ import annotations

from typing import Annotated

from moelab.cli._app import Opt
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError

Decoder = Annotated[
    str,
    Opt(
        help="causal (AR models), or for block-diffusion models vanilla, cache, cache+limit, team."
    ),
]
Threshold = Annotated[
    float,
    Opt(help="Diffusion decoders: confidence threshold τ."),
    Range(min=0, max=1, min_open=True),
]


def decode_options(model, decoder: str, threshold: float):
    """The :class:`~moelab.serve.diffusion.DecodeOptions` for a block-diffusion ``model``, or
    None for a causal one. Raises ``InvalidValueError`` when the decoder does not fit the model
    or is unknown, or τ is outside (0, 1]."""
    from moelab.serve.diffusion import DECODERS, DecodeOptions

    if decoder != "causal" and decoder not in DECODERS:
        raise InvalidValueError(f"decoder: must be causal, {', '.join(DECODERS)}; got {decoder!r}")
    objective = model.cfg.objective
    if objective == "causal":
        if decoder != "causal":
            raise InvalidValueError(
                f"decoder: {decoder!r} decodes block-diffusion models; this model is causal "
                "(use --decoder causal)"
            )
        return None
    if decoder == "causal":
        raise InvalidValueError(
            f"decoder: the model is a {objective} model; use --decoder vanilla, cache, "
            "cache+limit or team"
        )
    try:
        return DecodeOptions.preset(decoder, threshold)
    except ValueError as e:
        raise InvalidValueError(str(e)) from None
