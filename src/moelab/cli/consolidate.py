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
    out: Annotated[
        Path, typer.Argument(help="Folder to write (new or empty, outside the source).")
    ],
) -> None:
    """Merge the shards of an expert-parallel / FSDP2 checkpoint into one model folder.

    Runs in one process whatever the EP and world size of the run that wrote it. A run
    folder means its latest checkpoint (refused once the run finished: its final model is
    the run folder itself); the step written is printed and kept in consolidated.json.

    Examples:
      moelab consolidate runs/ep4 runs/ep4-step200
      moelab consolidate runs/ep4/checkpoints/step-000200 model/
    """
    from moelab.parallel import consolidate
    from moelab.parallel.checkpoint import CONSOLIDATED_FILE
    from moelab.utils.jsonfile import read_json

    folder = guarded(consolidate, src, out)
    record = read_json(folder / CONSOLIDATED_FILE)
    console.print(
        f"model folder of step {record['step']} written to {folder} (from {record['source']})"
    )
