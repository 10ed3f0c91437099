"""``moelab consolidate``: a sharded (DCP) checkpoint of an expert-parallel run → a normal
model / run folder. The work is done by :func:`moelab.parallel.consolidate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import app, console, guarded


@app.command("consolidate")
def consolidate_command(
    src: Annotated[
        Path, typer.Argument(help="Run folder (its latest checkpoint) or one checkpoint folder.")
    ],
    out: Annotated[Path, typer.Argument(help="Folder to write (must not exist or be empty).")],
) -> None:
    """Merge the shards of an expert-parallel / FSDP2 checkpoint into one model folder.

    Runs in one process whatever the EP and world size of the run that wrote it.

    Examples:
      moelab consolidate runs/ep4 runs/ep4-step200
      moelab consolidate runs/ep4/checkpoints/step-000200 model/
    """
    from moelab.parallel import consolidate

    folder = guarded(consolidate, src, out)
    console.print(f"model folder written to {folder}")
