"""``moelab flow train|sample``: MoLF conditional flow matching on slides of cells
(:mod:`moelab.methods.flow`)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded

flow_app = command_group(
    "flow", "MoLF: conditional flow matching with an MoE velocity field (expression prediction)."
)


@flow_app.command("train")
def train_command(
    out: Annotated[Path, Opt(help="Run folder to write (must not exist or be empty).")],
    data: Annotated[
        Path | None,
        Opt(help=".h5ad or .csv cells x genes (default: scanpy's bundled pbmc68k_reduced)."),
    ] = None,
    tissue_key: Annotated[str, Opt(help="obs column of each cell's tissue.")] = "lineage",
    slide_key: Annotated[
        str | None, Opt(help="obs column of real slide ids (default: pseudo-slides).")
    ] = None,
    view_key: Annotated[
        str | None, Opt(help="obsm matrix used as the condition (default: PCA of other genes).")
    ] = None,
    use_raw: Annotated[bool, Opt("--use-raw", help="Read raw.X of an .h5ad file.")] = False,
    variant: Annotated[str, Opt(help="shared, or conflict (tissue-rotated view).")] = "shared",
    velocity: Annotated[str, Opt(help="moe, dense, attention or simplemlp.")] = "moe",
    n_genes: Annotated[int, Opt(help="Target genes (highest variance).")] = 50,
    view_size: Annotated[int, Opt(help="PCA components of the view (without --view-key).")] = 32,
    slide_size: Annotated[int, Opt(help="Cells per slide.")] = 20,
    vae_steps: Annotated[int, Opt(help="VAE training steps.")] = 1500,
    flow_steps: Annotated[int, Opt(help="Flow (or SimpleMLP) training steps.")] = 3000,
    aux_loss_coeff: Annotated[float, Opt(help="Balance-loss weight (0: none).")] = 1.0,
    guidance: Annotated[float, Opt(help="CFG scale at sampling.")] = 2.0,
    euler_steps: Annotated[int, Opt(help="Euler steps at sampling.")] = 2,
    seed: Annotated[int, Opt(help="Seed of the split, the VAE and the model.")] = 0,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier run folder.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Train one arm (VAE, then the flow; or the SimpleMLP regressor), evaluate per-gene
    Pearson on the held-out slides, and save the run folder.

    Examples:
      moelab flow train --out runs/molf
      moelab flow train --variant conflict --velocity dense --out runs/molf-dense
      moelab flow train --data my.h5ad --tissue-key tissue --slide-key sample \\
          --view-key X_uni --out runs/molf-mine
    """
    from moelab.methods.flow import FlowConfig, evaluate_expression, train_expression
    from moelab.methods.flow.io import save_flow_run
    from moelab.utils.outdir import check_output_folder

    config = guarded(
        FlowConfig,
        data_path=None if data is None else str(data.resolve()),
        tissue_key=tissue_key,
        slide_key=slide_key,
        view_key=view_key,
        use_raw=use_raw,
        variant=variant,
        velocity=velocity,
        n_genes=n_genes,
        view_size=view_size,
        slide_size=slide_size,
        vae_steps=vae_steps,
        flow_steps=flow_steps,
        aux_loss_coeff=aux_loss_coeff,
        guidance=guidance,
        euler_steps=euler_steps,
    )
    inputs = [] if data is None else [data]
    guarded(check_output_folder, out, inputs=inputs, overwrite=overwrite)
    with console.status("training (VAE, then the flow)..."):
        run = guarded(train_expression, config, seed)
    metrics = evaluate_expression(run)
    guarded(save_flow_run, run, out, metrics, overwrite=overwrite)
    if as_json:
        console.print_json(json.dumps(metrics))
        return
    table = Table("metric", "value", title=f"held-out slides ({run.data.test.num_slides})")
    for name, value in metrics.items():
        if "/slide/" not in name:
            table.add_row(name, f"{value:.4f}")
    console.print(table)
    console.print(f"run folder written to {out}")


@flow_app.command("sample")
def sample_command(
    run: Annotated[Path, typer.Argument(help="Run folder of `moelab flow train`.")],
    out: Annotated[Path, Opt(help="CSV of predicted expression to write.")],
    split: Annotated[str, Opt(help="test (held-out slides) or train.")] = "test",
    guidance: Annotated[float | None, Opt(help="CFG scale (default: the run's).")] = None,
) -> None:
    """Predict the expression of a run's slides and write it as CSV: one row per cell with
    its slide, its row in the data file, its tissue, then the predicted target genes.

    Examples:
      moelab flow sample runs/molf --out pred.csv
      moelab flow sample runs/molf --split train --guidance 3 --out pred-train.csv
    """
    from moelab.errors import InvalidValueError
    from moelab.methods.flow import predict
    from moelab.methods.flow.io import load_flow_run
    from moelab.utils.atomic import atomic_write_text

    if split not in ("test", "train"):
        fail(InvalidValueError(f"--split: must be test or train, got {split!r}"))
    if guidance is not None and not guidance >= 0:
        fail(InvalidValueError(f"--guidance: must be >= 0, got {guidance}"))
    loaded = guarded(load_flow_run, run)
    slides = loaded.data.test if split == "test" else loaded.data.train
    pred, _ = predict(loaded, slides, guidance=guidance)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["slide", "cell", "tissue", *loaded.data.genes])
    for s in range(slides.num_slides):
        tissue = loaded.data.tissues[slides.tissue[s]]
        for p in range(slides.cells.shape[1]):
            row = [f"{v:.6g}" for v in pred[s, p]]
            writer.writerow([s, int(slides.cells[s, p]), tissue, *row])
    guarded(atomic_write_text, out, buf.getvalue())
    n = slides.num_slides * slides.cells.shape[1]
    console.print(f"{n} cells of {slides.num_slides} slides written to {out}")
