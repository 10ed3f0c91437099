"""``moelab convert``: Hugging Face checkpoint folder ↔ moelab model folder.

The work is done by :func:`moelab.interop.convert`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import app
from moelab.errors import InvalidValueError, UserError
from moelab.interop.hf import convert


@app.command("convert")
def convert_command(
    src: Annotated[Path, typer.Argument(help="Folder to read (HF checkpoint or moelab model).")],
    dst: Annotated[Path, typer.Argument(help="Folder to write (must not exist or be empty).")],
    to: Annotated[str, typer.Option(help="Target format: 'moelab' or 'hf'.")] = "moelab",
    arch: Annotated[
        str | None,
        typer.Option(
            help="HF architecture for --to hf: mixtral, qwen2_moe, qwen3_moe or olmoe "
            "(default: recorded at import, else inferred)."
        ),
    ] = None,
    layout: Annotated[
        str, typer.Option(help="Expert tensors for --to hf: per_expert or fused.")
    ] = "per_expert",
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty DST.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Convert a Hugging Face MoE checkpoint to a moelab model folder, or back.

    Examples:

        moelab convert ./Mixtral-tiny ./runs/mixtral --to moelab

        moelab convert ./runs/mixtral ./export/mixtral-hf --to hf --layout fused
    """
    try:
        if to not in ("moelab", "hf"):
            raise InvalidValueError(f"--to: must be 'moelab' or 'hf', got {to!r}")
        if layout not in ("per_expert", "fused"):
            raise InvalidValueError(f"--layout: must be 'per_expert' or 'fused', got {layout!r}")
        report = convert(src, dst, to, arch=arch, layout=layout, overwrite=overwrite)  # type: ignore[arg-type]
    except (UserError, OSError) as e:
        # the CLI's convention for user errors: one line, exit code 2
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(2) from e
    if json_out:
        d = asdict(report)
        d["dst"] = str(report.dst)
        typer.echo(json.dumps(d, indent=2))
        return
    typer.echo(f"wrote {report.dst} ({report.arch}, {report.layout} experts, to {to})")
    tok = ", ".join(report.copied_files) or "none"
    typer.echo(f"copied along: {tok}")
    for note in report.notes:
        typer.echo(f"note: {note}")
