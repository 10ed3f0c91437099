"""``moelab agent generate|train|evaluate``: CoME stage experts for GUI-agent reasoning on
MiniWoB++ chains (:mod:`moelab.methods.agents`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import SEED, Range

EvalSteps = Annotated[int, Opt(help="Held-out steps scored offline (0: all)."), Range(min=0)]
OnlineEpisodes = Annotated[
    int, Opt(help="Held-out episodes per task run in the browser (0: none)."), Range(min=0)
]

agent_app = command_group(
    "agent", "CoME: four stage experts for GUI-agent reasoning chains (MiniWoB++)."
)


def _print(metrics: dict[str, float], title: str, as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps(metrics))
        return
    table = Table("metric", "value", title=title)
    for name, value in metrics.items():
        table.add_row(name, f"{value:.4f}")
    console.print(table)


@agent_app.command("generate")
def generate_command(
    out: Annotated[Path, Opt(help="Chains file to write (.jsonl.gz).")],
    episodes: Annotated[int, Opt(help="Episodes (seeds 0..N-1) per task."), Range(min=1)] = 300,
    task: Annotated[
        list[str] | None, Opt(help="A MiniWoB++ task (repeat; default: all eight).")
    ] = None,
) -> None:
    """Run the scripted oracles in headless Chromium and write four-stage chains (needs
    ``pip install 'moelab[agents]'`` and ``apt-get install chromium chromium-driver``).

    Examples:
      moelab agent generate --out chains.jsonl.gz
      moelab agent generate --task login-user --task click-tab --episodes 20 --out small.jsonl.gz
    """
    from moelab.errors import InvalidValueError
    from moelab.methods.agents.browser import generate_chains
    from moelab.methods.agents.chain import write_chains
    from moelab.methods.agents.oracle import TASKS

    tasks = tuple(task) if task else TASKS
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        fail(InvalidValueError(f"--task: {unknown[0]!r} is not one of {', '.join(TASKS)}"))
    steps = guarded(generate_chains, tasks, range(episodes), progress=console.print)
    guarded(write_chains, out, steps)
    console.print(f"{len(steps)} chain steps written to {out}")


@agent_app.command("train")
def train_command(
    out: Annotated[Path, Opt(help="Run folder to write (must not exist or be empty).")],
    data: Annotated[
        Path | None, Opt(help="Chains .jsonl.gz (default: the shipped MiniWoB++ set).")
    ] = None,
    arm: Annotated[str, Opt(help="come, come_no_rft, token_moe or dense.")] = "come",
    dpo: Annotated[str, Opt(help="none, info (Info-DPO) or rule (Rule-DPO); CoME arms.")] = "none",
    warmup_steps: Annotated[int, Opt(help="Dense warm-up steps."), Range(min=0)] = 300,
    expert_steps: Annotated[int, Opt(help="Expert-FT steps."), Range(min=0)] = 100,
    router_steps: Annotated[int, Opt(help="Router-FT steps."), Range(min=0)] = 150,
    cot_steps: Annotated[int, Opt(help="CoT-FT steps."), Range(min=0)] = 100,
    eval_steps: EvalSteps = 0,
    online_episodes: OnlineEpisodes = 0,
    seed: Annotated[int, Opt(help="Seed of the models and batches."), SEED] = 0,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace an earlier run folder.")] = False,
    as_json: Annotated[bool, Opt("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Warm up a dense LM on the chains, train one arm, score it on held-out steps (and in
    the browser with --online-episodes), and save the run folder.

    Examples:
      moelab agent train --out runs/come
      moelab agent train --arm token_moe --out runs/token-moe
      moelab agent train --dpo info --online-episodes 10 --out runs/come-dpo
    """
    from moelab.methods.agents import ComeConfig, ComeRecipe
    from moelab.methods.agents.io import save_agent_run
    from moelab.utils.outdir import check_output_folder

    config = guarded(
        ComeConfig,
        data_path=None if data is None else str(data.resolve()),
        arm=arm,
        dpo=dpo,
        warmup_steps=warmup_steps,
        expert_steps=expert_steps,
        router_steps=router_steps,
        cot_steps=cot_steps,
        eval_steps=eval_steps,
        online_episodes=online_episodes,
    )
    guarded(check_output_folder, out, inputs=[] if data is None else [data], overwrite=overwrite)
    recipe = ComeRecipe()
    with console.status("training (dense warm-up, then the arm)..."):
        run, metrics = guarded(recipe.train, config, seed)
    metrics.update(_evaluate(run, config.eval_steps, online_episodes))
    guarded(save_agent_run, run, out, seed, metrics, overwrite=overwrite)
    _print(metrics, f"{arm}: held-out steps", as_json)
    console.print(f"run folder written to {out}")


def _evaluate(run, eval_steps: int, online_episodes: int) -> dict[str, float]:
    import dataclasses

    from moelab.methods.agents.online import evaluate_online
    from moelab.methods.agents.recipe import evaluate_run

    config = dataclasses.replace(run.config, eval_steps=eval_steps)
    metrics = evaluate_run(run.model, run.data, config)
    if online_episodes:
        metrics.update(guarded(evaluate_online, run, online_episodes))
    return metrics


@agent_app.command("evaluate")
def evaluate_command(
    run: Annotated[Path, typer.Argument(help="Run folder of `moelab agent train`.")],
    eval_steps: EvalSteps = 0,
    online_episodes: OnlineEpisodes = 0,
    as_json: Annotated[bool, Opt("--json", help="Print the metrics as JSON.")] = False,
) -> None:
    """Score a saved agent on the held-out steps (action match, stages, router alignment),
    and in the browser with --online-episodes.

    Examples:
      moelab agent evaluate runs/come
      moelab agent evaluate runs/come --online-episodes 20 --json
    """
    from moelab.methods.agents.io import load_agent_run

    loaded, _ = guarded(load_agent_run, run)
    _print(_evaluate(loaded, eval_steps, online_episodes), f"{run}: held-out steps", as_json)
