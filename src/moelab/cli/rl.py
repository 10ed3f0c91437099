"""``moelab rl train``: PA-MoE and its routing ablations on a MiniGrid task mix
(:mod:`moelab.methods.rl`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import SEED, Range

rl_app = command_group("rl", "PA-MoE: phase-aware MoE policies for RL (MiniGrid task mixes).")

_SHOWN = ("success/", "switches", "nmi", "frames_to_target", "auc")


@rl_app.command("train")
def train_command(
    out: Annotated[Path, Opt(help="Result JSON to write (moelab.result/1); a PNG plot beside it.")],
    arm: Annotated[
        list[str], Opt(help="pamoe, single, step or trajectory (repeat for several arms).")
    ] = ["pamoe"],  # noqa: B006  (typer needs a list default)
    seed: Annotated[list[int], Opt(help="Seeds (repeat for several).", show_default=True)] = [0],  # noqa: B006
    task: Annotated[
        list[str] | None,
        Opt(help="Gymnasium ids (repeat); the last is the complex task. Default: the spec's mix."),
    ] = None,
    task_weight: Annotated[
        list[float] | None, Opt(help="Sampling weight per --task (sum 1).")
    ] = None,
    frames: Annotated[
        int, Opt(help="Environment steps of training per run."), Range(min=1)
    ] = 400_000,
    estimator: Annotated[str, Opt(help="gigpo, grpo or gae (PPO with a value head).")] = "gigpo",
    max_steps: Annotated[
        int, Opt(help="Episode cap (0: each task's own limit)."), Range(min=0)
    ] = 0,
    eval_every: Annotated[
        int, Opt(help="Frames between greedy evaluations."), Range(min=1)
    ] = 50_000,
    eval_episodes: Annotated[
        int, Opt(help="Held-out seeds per task at each curve point."), Range(min=1)
    ] = 20,
    final_episodes: Annotated[
        int, Opt(help="Held-out seeds per task of the final evaluation."), Range(min=1)
    ] = 100,
    checkpoint_dir: Annotated[
        Path | None, Opt(help="Keep resumable checkpoints here; a rerun resumes from them.")
    ] = None,
    progress: Annotated[bool, Opt("--progress/--no-progress", help="Progress bars.")] = True,
    as_json: Annotated[bool, Opt("--json", help="Print the per-arm means as JSON.")] = False,
) -> None:
    """Train each arm for each seed, evaluate greedily on held-out seeds, and write the shared
    result JSON (per-seed metrics, mean ± sd, paired differences against the first arm) and a
    learning-curve PNG.

    Examples:
      moelab rl train --out runs/pamoe.json --frames 100000
      moelab rl train --arm pamoe --arm single --arm step --arm trajectory \\
          --seed 0 --seed 1 --seed 2 --out runs/pa-moe.json
      moelab rl train --arm single --estimator gae --out runs/single-gae.json
    """
    from moelab.errors import InvalidValueError
    from moelab.methods.rl import ARMS, PAMoERecipe, RLConfig
    from moelab.methods.rl.plot import plot_learning_curves
    from moelab.methods.runner import run_seeds

    for s in seed:
        if not SEED.holds(s):
            fail(InvalidValueError(f"--seed: must be {SEED.describe()}, got {s}"))
    bad = [a for a in arm if a not in ARMS]
    if bad:
        fail(InvalidValueError(f"--arm: must be one of {', '.join(ARMS)}, got {bad[0]!r}"))
    if len(set(arm)) != len(arm):
        fail(InvalidValueError(f"--arm: each arm once, got {arm}"))
    mix = {}
    if task:
        weights = task_weight or [1.0 / len(task)] * len(task)
        mix = {"tasks": tuple(task), "task_weights": tuple(weights)}
    elif task_weight:
        fail(InvalidValueError("--task-weight: give --task too"))
    config = guarded(
        RLConfig,
        arm=arm[0],
        frames=frames,
        estimator=estimator,
        max_steps=max_steps,
        eval_every=eval_every,
        eval_episodes=eval_episodes,
        final_episodes=final_episodes,
        **mix,
    )
    arms = {a: {"arm": a} for a in arm}
    recipe = PAMoERecipe(checkpoint_dir, progress=progress)
    result = guarded(run_seeds, recipe, config, seed, arms=arms, out=out)
    plot = guarded(plot_learning_curves, result, out.with_suffix(".png"))
    summary = result.summary()
    if as_json:
        means = {a: {k: s.mean for k, s in m.items()} for a, m in summary.items()}
        console.print_json(json.dumps(means))
        return
    names = [k for k in result.metric_names(arm[0]) if k.startswith(_SHOWN)]
    table = Table("arm", *names, title=f"greedy evaluation ({len(seed)} seed(s))")
    for a in result.arms:
        table.add_row(a, *(f"{summary[a][k].mean:.3f}" for k in names))
    console.print(table)
    console.print(f"result written to {out}; learning curves to {plot}")
