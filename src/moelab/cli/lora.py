"""``moelab merge-lora``: fold a run's expert LoRA adapters into its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._common import load_run


@app.command("merge-lora")
def merge_lora_cmd(
    run: Annotated[Path, typer.Argument(help="Run or model folder with expert LoRA adapters.")],
    out: Annotated[Path, Opt(help="Folder for the merged model (must not exist or be empty).")],
) -> None:
    """Merge the LoRA adapters of a run (``moelab train --lora-rank r``) into the expert
    weights: a plain model folder with the same outputs and the run's tokenizer.

    Examples:
      moelab train --init-from runs/main --lora-rank 8 --steps 200 --out runs/main-lora
      moelab merge-lora runs/main-lora --out runs/main-merged
    """
    n = guarded(_merge, run, out)
    console.print(f"merged the adapters of {n} MoE layers: {out}")


def _merge(run: Path, out: Path) -> int:
    from moelab.models import save_model
    from moelab.models.lora import merge_expert_lora
    from moelab.utils.atomic import write_folder_atomically
    from moelab.utils.outdir import check_output_folder

    check_output_folder(out, inputs=[run], flag=None)
    model, tokenizer = load_run(run)
    merged = merge_expert_lora(model)

    def fill(tmp: Path) -> None:
        save_model(merged, tmp)
        tokenizer.save(tmp)

    write_folder_atomically(out, fill, inputs=[run], flag=None)
    return merged.cfg.num_moe_layers
