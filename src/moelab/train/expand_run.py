"""Offline width expansion of a run: ``moelab expand RUN --hidden 2x --out DIR``.

Reads RUN's latest checkpoint (model *and* optimizer state, which SPARKLING's asymmetric state
handling needs), grows both exactly as an in-loop ``--expand-at`` would at that step
(:func:`moelab.train.expand.expand_in_training`: same calibration batch, same random draws),
and writes DIR as a run folder that ``moelab train --out DIR --resume`` continues:

    run.json        the grown model config; the train settings without the expand_* fields
    tokenizer files, metrics.jsonl (RUN's, plus an ``expand`` line)
    checkpoints/    one checkpoint at the same step: grown model, sharded optimizer state,
                    RNG and data-order state, tokens seen, elapsed time

DIR is assembled in a temporary sibling folder and renamed into place; RUN is never modified.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

from moelab.data import load_tokenizer
from moelab.models import CheckpointError, ModelConfig
from moelab.train.checkpoint import load_checkpoint, save_checkpoint
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.expand import (
    REWARM_RATIO,
    ExpandSpec,
    check_expansion,
    default_rewarm_steps,
    expand_in_training,
    expansion_record,
)
from moelab.train.loop import RUN_FILE, prepare_data, read_run_info
from moelab.train.metrics import MetricsLog
from moelab.train.optim import build_optimizer
from moelab.utils.atomic import atomic_write_json, write_folder_atomically
from moelab.utils.outdir import check_output_folder


@dataclass
class ExpandRunResult:
    """What :func:`expand_run` wrote: the folder, the step, and the old and new configs."""

    out: Path
    step: int
    old: ModelConfig
    new: ModelConfig
    spec: ExpandSpec


def expand_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    hidden: float | None = None,
    inner: float | None = None,
    init: str = "sparkling",
    state: str = "asymmetric",
    rewarm_steps: int | None = None,
    rewarm_ratio: float = REWARM_RATIO,
    rewarm_tail: str = "base",
) -> ExpandRunResult:
    """Grow the latest checkpoint of ``run_dir`` into a new run folder ``out_dir``.

    Args:
        run_dir: a run folder with a checkpoint (``moelab train`` writes them every
            ``--checkpoint-every`` steps and on Ctrl-C).
        out_dir: the new run folder (must not exist or be empty).
        hidden, inner: width factors (> 1) of the hidden size and the expert/FFN inner size.
        init, state: see :class:`ExpandSpec`.
        rewarm_steps: τ_w, re-warmup steps of the new entries (None:
            :func:`moelab.train.expand.default_rewarm_steps` of the steps left).
        rewarm_ratio: ρ, their re-warmup peak over the rate at the expansion (paper 1.3).
        rewarm_tail: ``"base"`` (a short boost, then the base schedule) or ``"own"`` (their
            own cosine to the end); see :class:`ExpandSpec`.
    Raises:
        ConfigError: not a run folder, a finished run, the checkpoint at or past the last step,
            an in-loop expansion still pending, bad factors; CheckpointError: no checkpoint
            (so no optimizer state) or a corrupt one; OutputFolderError
            (:func:`~moelab.utils.outdir.check_output_folder`): ``out_dir`` is, surrounds or lies
            inside the run, or is not empty (``OutputExistsError``, a FileExistsError).
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    check_output_folder(out_dir, inputs=[run_dir], flag=None)  # not in/around the source
    info = read_run_info(run_dir)
    cfg = TrainConfig.from_dict(info["train"])
    ckpt = load_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(
            f"{run_dir}: no checkpoint, so no optimizer state to carry over (a finished run "
            "keeps only its model); expand a run that has checkpoints/"
        )
    step = ckpt.step
    if step >= cfg.steps:
        raise ConfigError(
            f"{run_dir}: its checkpoint is at the last step {step}; nothing to expand"
        )
    if cfg.expand_at is not None and step <= cfg.expand_at:
        raise ConfigError(
            f"{run_dir}: an in-loop expansion at step {cfg.expand_at} is still pending"
        )
    left = cfg.steps - step
    spec = ExpandSpec(
        hidden=hidden,
        inner=inner,
        init=init,
        state=state,
        rewarm_steps=default_rewarm_steps(left) if rewarm_steps is None else rewarm_steps,
        rewarm_ratio=rewarm_ratio,
        rewarm_tail=rewarm_tail,
    )
    check_expansion(ckpt.model.cfg, spec, ckpt.model)
    tokenizer = load_tokenizer(run_dir)
    _, train_stream, _ = prepare_data(cfg, tokenizer)
    optimizer = build_optimizer(ckpt.model, cfg, ckpt.state["optimizer"])
    grown = expand_in_training(ckpt.model, optimizer, spec, cfg, train_stream, step)
    new_cfg = dataclasses.replace(
        cfg, expand_at=None, expand_hidden=None, expand_expert=None, rewarm_steps=None
    )
    trainer_state = {**ckpt.state, "optimizer": grown.optimizer.state_dict()}

    def fill(tmp: Path) -> None:
        tokenizer.save(tmp)
        atomic_write_json(
            tmp / RUN_FILE, {"model": grown.model.cfg.to_dict(), "train": new_cfg.to_dict()}
        )
        metrics = tmp / "metrics.jsonl"
        if (run_dir / "metrics.jsonl").exists():
            shutil.copyfile(run_dir / "metrics.jsonl", metrics)
        log = MetricsLog(metrics)
        log.truncate_after(step)
        log.write(expansion_record(step, grown.model.cfg, spec))
        save_checkpoint(tmp, grown.model, trainer_state, step)

    write_folder_atomically(out_dir, fill, inputs=[run_dir], flag=None)
    return ExpandRunResult(out_dir, step, ckpt.model.cfg, grown.model.cfg, spec)
