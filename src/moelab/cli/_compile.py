"""``--compile`` of ``moelab generate`` and ``moelab serve``: compiled causal decode steps."""

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


def check_compile(compile: bool, offload: bool, decoder: str) -> None:
    """Refuse ``--compile`` where it does not apply.

    Raises:
        ValueError: with ``--offload`` (the expert store's reads and cache live in Python
            inside every MoE layer) or with a block-diffusion ``--decoder``.
    """
    if compile and offload:
        raise InvalidValueError("--compile: not with --offload (experts are read from the store)")
    if compile and decoder != "causal":
        raise InvalidValueError(f"--compile: applies to causal decoding, not --decoder {decoder}")
