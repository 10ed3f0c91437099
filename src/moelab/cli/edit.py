"""``moelab edit apply``: lifelong knowledge editing of a causal LM with TIME's CP-tensor
experts or a baseline (:mod:`moelab.methods.editing`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, command_group, console, guarded
from moelab.cli._ranges import SEED, Range

edit_app = command_group(
    "edit", "Lifelong knowledge editing: TIME (CP-tensor experts), LoRA + key, GRACE, FT-L."
)


@edit_app.command("apply")
def apply_command(
    model: Annotated[
        str, typer.Argument(help="Run or model folder, or a pretrained name (smollm2).")
    ],
    edits: Annotated[Path, typer.Argument(help=".jsonl or .csv with prompt and target fields.")],
    out: Annotated[Path, Opt(help="Folder for the edited state (must not exist or be empty).")],
    method: Annotated[str, Opt(help="time, lora-key, grace or ft-l.")] = "time",
    layer: Annotated[
        str, Opt(help="Dotted name of the edited nn.Linear.")
    ] = "blocks.22.ffn.w_down",
    rank: Annotated[int, Opt(help="CP rank (time) or LoRA rank (lora-key)."), Range(min=1)] = 4,
    steps: Annotated[int, Opt(help="Adam steps per edit."), Range(min=1)] = 15,
    capacity: Annotated[int, Opt(help="Most edits the model may hold."), Range(min=1)] = 1000,
    seed: Annotated[int, Opt(help="Seed of the edit experts' initialisation."), SEED] = 0,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier edit folder.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print the per-edit results as JSON.")] = False,
) -> None:
    """Apply a stream of edits one at a time (old edits frozen), check each edit's prompt
    after the whole stream (teacher-forced: does the model now predict the target?), and save
    the edited state. The folder loads wherever a model folder does (``moelab generate``,
    ``moelab serve``): the base model is loaded and the edits applied to it.

    A file row is ``{"prompt": "The capital city of France is", "target": " Rome"}``; the
    target is appended to the prompt as written (start it with a space after a word). The
    whole file is checked (fields, empty targets, tokenisation, capacity) before any edit.

    Examples:
      moelab edit apply smollm2 edits.jsonl --out runs/edited
      moelab edit apply smollm2 edits.csv --method grace --out runs/edited-grace
      moelab generate runs/edited --prompt "The capital city of France is"
    """
    import torch

    from moelab.cli._common import load_run
    from moelab.methods.editing import EditConfig, Editor, read_edits, save_edits, tokenize_edit
    from moelab.utils.outdir import check_output_folder

    requests = guarded(read_edits, edits)
    config = guarded(
        EditConfig,
        model=model,
        layer=layer,
        method=method,
        rank=rank,
        steps=steps,
        capacity=capacity,
    )
    guarded(check_output_folder, out, inputs=[edits], overwrite=overwrite)
    base, tokenizer = guarded(load_run, Path(model))
    base.eval()
    editor = guarded(Editor, base, config)
    torch.manual_seed(seed)
    with console.status(f"applying {len(requests)} edits ({method})...") as status:
        guarded(
            editor.apply_stream,
            requests,
            tokenizer,
            lambda i, s: status.update(f"edit {i + 1}/{len(requests)} ({s:.1f} s)"),
        )
    rows = []
    for request in requests:
        edit = tokenize_edit(request, tokenizer, base.cfg.max_seq_len)
        with torch.no_grad():
            logits = editor.logits(edit.input_ids[None])[0, edit.positions]
        hits = (logits.argmax(-1) == edit.targets).float().mean().item()
        rows.append({"prompt": request.prompt, "target": request.target, "accuracy": 100 * hits})
    source = model if not Path(model).is_dir() else str(Path(model).resolve())
    guarded(save_edits, editor, out, source, overwrite=overwrite)
    if as_json:
        console.print_json(json.dumps({"edits": rows, "params_per_edit": editor.params_per_edit}))
        return
    table = Table(
        "prompt", "target", "token accuracy %", title=f"{method}: after {len(rows)} edits"
    )
    for r in rows:
        table.add_row(r["prompt"], repr(r["target"]), f"{r['accuracy']:.0f}")
    console.print(table)
    console.print(f"{editor.params_per_edit} parameters per edit; edited state written to {out}")
