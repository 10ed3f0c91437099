"""``--compile`` and ``--fused`` of ``moelab generate`` and ``moelab serve``: how the causal
decode steps run (compiled by torch.compile, or as one C++ call each)."""

from __future__ import annotations

from typing import Annotated

from moelab.cli._app import Opt
from moelab.errors import InvalidValueError

CompileFlag = Annotated[
    bool,
    Opt(
        "--compile",
        help="Decode through torch.compile (compiles on the first token, tens of seconds; "
        "then faster per token).",
    ),
]

FusedFlag = Annotated[
    bool,
    Opt(
        "--fused",
        help="Decode each step as one C++ call over every block (float32 or 4/8-bit "
        "weights, token-choice routers; no compile).",
    ),
]


def check_compile(compile: bool, offload: bool, decoder: str, fused: bool = False) -> None:
    """Refuse ``--compile`` and ``--fused`` where they do not apply.

    Raises:
        ValueError: either with ``--offload`` (the expert store's reads and cache live in
            Python inside every MoE layer) or with a block-diffusion ``--decoder``; both.
    """
    if compile and fused:
        raise InvalidValueError("--compile, --fused: choose one")
    flag = "--compile" if compile else "--fused" if fused else None
    if flag and offload:
        raise InvalidValueError(f"{flag}: not with --offload (experts are read from the store)")
    if flag and decoder != "causal":
        raise InvalidValueError(f"{flag}: applies to causal decoding, not --decoder {decoder}")
