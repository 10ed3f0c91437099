"""``moelab continual run``: class-incremental learning on a frozen MiniLM encoder — CaRE and
its baselines (:mod:`moelab.methods.continual`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import Range

continual_app = command_group(
    "continual", "Continual learning on a frozen pretrained encoder (CaRE and baselines)."
)


def _seeds(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; one red line for anything else."""
    from moelab.errors import InvalidValueError
    from moelab.utils.fields import check_seed

    parts = [x for x in text.replace(" ", ",").split(",") if x]
    if not parts or not all(p.isdigit() for p in parts):
        fail(InvalidValueError(f"--seeds: expected comma-separated integers >= 0, got {text!r}"))
    return [guarded(check_seed, int(p), "--seeds") for p in parts]


@continual_app.command("run")
def run_command(
    out: Annotated[Path, Opt(help="Result JSON to write (the plot goes beside it, .png).")],
    method: Annotated[
        str,
        Opt(
            help="care, simplecil, aper or finetune; on a domain stream also the upcycling "
            "arms selective-upcycling, full-upcycling or seqft-replay (task scenario), same, "
            "moelora or seqlora (instruction tuning, SAME and its baselines) and moram, "
            "prompt-moe-lora, prompt-seq-lora or zeroshot (label-prompt classifiers, MoRAM and "
            "its baselines); a comma list runs "
            "several, paired against the first."
        ),
    ] = "care",
    stream: Annotated[
        str,
        Opt(
            help="wordnet (WordNet hypernym classes), domains (one task per real text "
            "domain: 5 tasks, 78 classes), synthetic or synthetic-domains."
        ),
    ] = "wordnet",
    scenario: Annotated[
        str | None,
        Opt(
            help="class, task or domain (default: class on wordnet/synthetic, domain on "
            "the domain streams)."
        ),
    ] = None,
    seeds: Annotated[str, Opt(help="Comma-separated seeds (class order, split, init).")] = "0",
    tasks: Annotated[int, Opt(help="Number of tasks."), Range(min=1)] = 54,
    classes_per_task: Annotated[int, Opt(help="Classes per task."), Range(min=1)] = 2,
    num_classes: Annotated[
        int, Opt(help="Classes taken from the data (largest)."), Range(min=1)
    ] = 108,
    adapted_blocks: Annotated[
        int, Opt(help="Top encoder blocks with adapters (the rest is cached)."), Range(min=1)
    ] = 2,
    max_tokens: Annotated[
        int, Opt(help="Tokens kept per text ([CLS] and [SEP] included)."), Range(min=3)
    ] = 32,
    epochs: Annotated[int, Opt(help="Epochs on each task after the first."), Range(min=2)] = 6,
    first_task_epochs: Annotated[int, Opt(help="Epochs on the first task."), Range(min=1)] = 10,
    steps_per_task: Annotated[
        int, Opt(help="Training steps per task of the upcycling arms."), Range(min=1)
    ] = 40,
    train_per_class: Annotated[
        int, Opt(help="Training texts per class (MoRAM's X-TAIL: 16)."), Range(min=1)
    ] = 40,
    test_per_class: Annotated[int, Opt(help="Test texts per class."), Range(min=1)] = 10,
    iterations: Annotated[
        int,
        Opt(help="Steps per domain of moram, moe-lora and seq-lora (batch 16)."),
        Range(min=1),
    ] = 80,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an existing result.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print the result summary as JSON.")] = False,
) -> None:
    """Run the methods through a class-incremental stream (task-agnostic test after every
    task) and write the shared result JSON (Ā, last accuracy, forgetting, BWT per seed, paired
    differences) and an accuracy-over-tasks plot.

    Examples:
      moelab continual run --method care --seeds 0,1,2 --out runs/care.json
      moelab continual run --method care,simplecil,aper,finetune --tasks 10 --out runs/cl.json
      moelab continual run --method care --adapted-blocks 6 --tasks 10 --out runs/care6.json
      moelab continual run --method finetune --stream domains --scenario task --out runs/d.json
      moelab continual run --method selective-upcycling,full-upcycling,seqft-replay
        --stream domains --scenario task --adapted-blocks 6 --out runs/upcycling.json
      moelab continual run --method same,moelora,seqlora --stream domains --adapted-blocks 3 \
        --max-tokens 48 --out runs/same.json
      moelab continual run --method moram,moe-lora,seq-lora,zeroshot --stream domains \
        --train-per-class 16 --test-per-class 20 --adapted-blocks 3 --out runs/moram.json
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from moelab.errors import InvalidValueError
    from moelab.methods.continual import ContinualConfig, ContinualRecipe
    from moelab.methods.continual.config import DOMAIN_STREAMS
    from moelab.methods.continual.moram_config import MoRAMSettings
    from moelab.methods.continual.recipe import run_methods
    from moelab.methods.continual.upcycling_settings import UpcyclingSettings

    methods = [m.strip() for m in method.split(",") if m.strip()]
    seed_list = _seeds(seeds)
    if out.exists() and not overwrite:
        fail(InvalidValueError(f"--out: {out} exists (pass --overwrite to replace it)"))
    if scenario is None:
        scenario = "domain" if stream in DOMAIN_STREAMS else "class"
    config = guarded(
        ContinualConfig,
        stream=stream,
        scenario=scenario,
        method=methods[0] if methods else "care",
        num_tasks=tasks,
        classes_per_task=classes_per_task,
        num_classes=num_classes,
        adapted_blocks=adapted_blocks,
        max_tokens=max_tokens,
        epochs=epochs,
        first_task_epochs=first_task_epochs,
        upcycling=guarded(UpcyclingSettings, steps=steps_per_task),
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        moram=MoRAMSettings(iterations=iterations),
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("A_t {task.fields[acc]}"),
        console=console,
        transient=True,
    ) as bar:
        bars: dict[tuple[str, int], int] = {}

        def progress(m: str, seed: int, t: int, T: int, acc: float) -> None:
            key = (m, seed)
            if key not in bars:
                bars[key] = bar.add_task(f"{m} seed {seed}", total=T, acc="")
            bar.update(bars[key], completed=t + 1, acc=f"{acc:.1f}%")

        recipe = ContinualRecipe(progress=progress)
        result = guarded(run_methods, config, methods, seed_list, recipe=recipe, out=out)
    summary = result.summary()
    if as_json:
        console.print_json(
            json.dumps({a: {k: s.mean for k, s in v.items()} for a, v in summary.items()})
        )
        return
    names = ["avg_acc", "last_acc", "forgetting", "bwt", "transfer", "xtail_average", "xtail_last"]
    names += ["router_drift", "noprior_last_acc"]
    names = [n for n in names if any(n in per for per in summary.values())]
    shape = f"{tasks} tasks" if stream not in DOMAIN_STREAMS else f"{scenario} scenario"
    table = Table("method", *names, title=f"{stream}: {shape}, seeds {seed_list} (%, mean)")
    for arm, per in summary.items():
        table.add_row(arm, *(f"{per[n].mean:.2f}" if n in per else "-" for n in names))
    console.print(table)
    console.print(f"result written to {out}, plot to {out.with_suffix('.png')}")
