"""Calibration options shared by ``moelab prune`` and ``moelab quantize``."""

from __future__ import annotations

from typing import Annotated

from moelab.cli._app import Opt
from moelab.cli._ranges import Range

CalibData = Annotated[
    str | None,
    Opt(help="Calibration corpus (default: held-out documents of the run's training data)."),
]
CalibTokens = Annotated[
    int, Opt(help="Calibration tokens (split equally over domains)."), Range(min=1)
]
CalibSeqLen = Annotated[
    int | None, Opt(help="Calibration window (default: the run's)."), Range(min=1)
]
CalibBatch = Annotated[int, Opt(help="Calibration sequences per batch."), Range(min=1)]
