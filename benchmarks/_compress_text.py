"""The text of the compression benchmarks (``prune.py``, ``quantize.py``): which documents
calibrate and which evaluate a run or a bare model folder, and the options that choose them."""

from __future__ import annotations

import argparse
from pathlib import Path

from moelab.compress import RunData, held_out_documents, run_data, training_documents
from moelab.data import Document


def add_text_options(parser: argparse.ArgumentParser) -> None:
    """``--calib-from`` and ``--data``."""
    parser.add_argument(
        "--calib-from",
        default="held-out",
        choices=["held-out", "train"],
        help="calibration text: the first half of the held-out documents, or the training split "
        "(the papers' 32,768 tokens exceed a small domain's held-out half) [I]; evaluation is "
        "the second held-out half either way",
    )
    parser.add_argument(
        "--data",
        default="mix",
        help="corpus of a model folder without run.json (e.g. an upcycled SmolLM2): its "
        "validation split is held out as for a run",
    )


def text_documents(folder: Path, args: argparse.Namespace) -> tuple[list[Document], list[Document]]:
    """``(calibration, evaluation)`` documents of a run (its ``run.json`` data) or a bare model
    folder (``--data``), calibration as ``--calib-from`` says."""
    rd = run_data(folder) or RunData(args.data)
    calib, evaluation = held_out_documents(rd)
    return (training_documents(rd) if args.calib_from == "train" else calib), evaluation
