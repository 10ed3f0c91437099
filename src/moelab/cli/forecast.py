"""``moelab forecast train``: TiMi's multimodal MoE forecaster and its baselines
(:mod:`moelab.methods.forecasting`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import Range

forecast_app = command_group(
    "forecast", "TiMi: text-steered MoE forecasting (PatchTST-lite with the MMoE plug-in)."
)

_SHOWN = ("mse", "mse_event", "mse_free", "mae_event", "mae_free")


def _seeds(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``."""
    from moelab.errors import InvalidValueError

    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise InvalidValueError(f"--seeds: comma-separated integers >= 0, got {text!r}")
    return seeds


@forecast_app.command("train")
def train_command(
    out: Annotated[Path, Opt(help="Result JSON to write (moelab.result/1).")],
    arms: Annotated[
        str,
        Opt(
            help="Comma-separated arms, the first compared with the others: mmoe, unimodal, "
            "concat, tmoe, smoe, shuffled."
        ),
    ] = "mmoe,unimodal",
    seeds: Annotated[
        str, Opt(help="Comma-separated seeds (events, splits of data, weights).")
    ] = "0",
    data: Annotated[
        Path | None,
        Opt(help="CSV with timestamp,value,text columns (default: taylor with injected events)."),
    ] = None,
    variant: Annotated[str, Opt(help="taylor events: whole (horizon) or partial.")] = "whole",
    lookback: Annotated[int, Opt(help="Look-back steps."), Range(min=1)] = 336,
    horizon: Annotated[int, Opt(help="Forecast steps."), Range(min=1)] = 48,
    stride: Annotated[int, Opt(help="Steps between window starts."), Range(min=1)] = 4,
    text_encoder: Annotated[str, Opt(help="Frozen text encoder: smollm2 or minilm.")] = "smollm2",
    text_cache: Annotated[
        Path | None, Opt(help="A .safetensors file keeping encoded texts between runs.")
    ] = None,
    epochs: Annotated[int, Opt(help="Training epochs."), Range(min=1)] = 40,
    lr: Annotated[float, Opt(help="Learning rate."), Range(min=0, min_open=True)] = 1e-3,
    as_json: Annotated[bool, Opt("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train and test each arm for each seed; write the shared result file and print MSE/MAE
    on event and event-free test windows (scaled by the train std).

    Examples:
      moelab forecast train --out runs/timi.json
      moelab forecast train --arms mmoe,unimodal,concat --seeds 0,1,2 --out runs/timi.json
      moelab forecast train --variant partial --arms mmoe,concat --out runs/partial.json
      moelab forecast train --data demand.csv --arms mmoe,unimodal --out runs/mine.json
    """
    from moelab.errors import InvalidValueError
    from moelab.methods.forecasting import ARMS, ForecastConfig, TextCache, TiMiRecipe
    from moelab.methods.runner import run_seeds

    arm_list = [a.strip() for a in arms.split(",") if a.strip()]
    bad = [a for a in arm_list if a not in ARMS]
    if bad or not arm_list or len(set(arm_list)) != len(arm_list):
        fail(InvalidValueError(f"--arms: distinct names among {', '.join(ARMS)}, got {arms!r}"))
    seed_list = guarded(_seeds, seeds)
    config = guarded(
        ForecastConfig,
        data_path=None if data is None else str(data.resolve()),
        variant=variant,
        lookback=lookback,
        horizon=horizon,
        stride=stride,
        text_encoder=text_encoder,
        text_cache=None if text_cache is None else str(text_cache),
        arm=arm_list[0],
        epochs=epochs,
        lr=lr,
    )
    recipe = TiMiRecipe(TextCache(text_encoder, path=text_cache))
    with console.status(f"training {len(arm_list)} arm(s) x {len(seed_list)} seed(s)..."):
        result = guarded(
            run_seeds,
            recipe,
            config,
            seed_list,
            arms={a: {"arm": a} for a in arm_list},
            out=out,
        )
    summary = result.summary()
    rows = {arm: {m: summary[arm][m].mean for m in _SHOWN if m in summary[arm]} for arm in arm_list}
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table("arm", *_SHOWN, title=f"test windows, mean over seeds {seed_list}")
    for arm in arm_list:
        table.add_row(arm, *(f"{rows[arm][m]:.4f}" if m in rows[arm] else "" for m in _SHOWN))
    console.print(table)
    console.print(f"result written to {out}")
