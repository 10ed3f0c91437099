"""``moelab convert``: Hugging Face checkpoint folder ↔ moelab model folder, and moelab model
→ GGUF file for llama.cpp.

The work is done by :func:`moelab.interop.convert` and :func:`moelab.interop.export_gguf`.
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
    dst: Annotated[
        Path,
        typer.Argument(help="Folder to write (must not exist or be empty); --to gguf: a file."),
    ],
    to: Annotated[str, typer.Option(help="Target format: 'moelab', 'hf' or 'gguf'.")] = "moelab",
    arch: Annotated[
        str | None,
        typer.Option(
            help="Architecture: for --to hf mixtral, qwen2_moe, qwen3_moe or olmoe (default: "
            "recorded at import, else inferred); for --to gguf llama, qwen2moe, qwen3moe or "
            "olmoe (or the HF names; default inferred)."
        ),
    ] = None,
    layout: Annotated[
        str, typer.Option(help="Expert tensors for --to hf: per_expert or fused.")
    ] = "per_expert",
    outtype: Annotated[
        str,
        typer.Option(
            help="Matrices' type for --to gguf: auto (the model's dtype), f32, f16, bf16, or "
            "llama.cpp's q8_0, q5_1, q5_0, q4_1, q4_0, q4_k (bit-exact with llama-quantize)."
        ),
    ] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty DST.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Convert a Hugging Face MoE checkpoint to a moelab model folder, or back; or write a
    moelab model as one GGUF file for llama.cpp / Ollama (docs/how-to/gguf.md).

    Examples:

        moelab convert ./Mixtral-tiny ./runs/mixtral --to moelab

        moelab convert ./runs/mixtral ./export/mixtral-hf --to hf --layout fused

        moelab convert ./runs/main ./export/main-q8_0.gguf --to gguf --outtype q8_0

        moelab convert ./runs/main ./export/main-q4_k.gguf --to gguf --outtype q4_k
    """
    if to == "gguf":
        _to_gguf(src, dst, arch, outtype, overwrite, json_out)
        return
    try:
        if to not in ("moelab", "hf"):
            raise InvalidValueError(f"--to: must be 'moelab', 'hf' or 'gguf', got {to!r}")
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


def _to_gguf(
    src: Path, dst: Path, arch: str | None, outtype: str, overwrite: bool, json_out: bool
) -> None:
    from moelab.cli._chat import chat_template_for
    from moelab.cli._common import load_run
    from moelab.interop.gguf_export import export_gguf

    try:
        model, tokenizer = load_run(src)
        template = chat_template_for(src)
        report = export_gguf(
            model,
            dst,
            tokenizer=tokenizer,
            arch=arch,
            outtype=outtype,
            chat_template=template.jinja,
            bos_token=template.bos_token or None,
            eos_token=template.eos_token or None,
            name=src.resolve().name if src.is_dir() else str(src),
            overwrite=overwrite,
        )
    except (UserError, OSError) as e:
        typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
        raise typer.Exit(2) from e
    if json_out:
        d = asdict(report)
        d["path"] = str(report.path)
        typer.echo(json.dumps(d, indent=2))
        return
    types = ", ".join(f"{n} {k}" for k, n in sorted(report.tensor_types.items()))
    typer.echo(
        f"wrote {report.path} (llama.cpp {report.arch!r}, {report.outtype}: {types}; "
        f"{report.bytes / 1e6:.1f} MB)"
    )
    plain = " (moelab's plain template)" if template.is_plain else ""
    typer.echo(f"tokenizer: {report.tokenizer}; chat template{plain}")
    for note in report.notes:
        typer.echo(f"note: {note}")
