"""Training checkpoints: model folder + optimizer/RNG/data-order state, written atomically.

Layout inside a run folder::

    checkpoints/step-000200/   config.json, model.safetensors, manifest.json (moelab.models.io)
                               trainer_state.pt (optimizer, step, RNG and batch-sampler state)
    checkpoints/latest.json    {"format_version": 1, "step": 200, "dir": "step-000200"}

A checkpoint folder is filled under a temporary name and renamed into place; ``latest.json``
is replaced atomically afterwards, so an interrupted write never becomes the latest
checkpoint. The two most recent checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelab.models import CheckpointError, MoETransformer, load_model, save_model
from moelab.utils.atomic import atomic_write, atomic_write_json, fsync_dir

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest.json"
KEEP = 2
STATE_KEYS = frozenset({"step", "optimizer", "torch_rng", "generator", "tokens_seen", "elapsed_s"})


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model and the trainer state dict saved with it."""

    model: MoETransformer
    state: dict[str, Any]
    step: int


def save_checkpoint(run_dir: Path, model: MoETransformer, state: dict[str, Any], step: int) -> Path:
    """Write ``model`` and ``state`` (tensors, numbers, nested dicts) as the checkpoint of ``step``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    atomic_write(
        tmp / STATE_FILE, lambda p: torch.save({"format_version": FORMAT_VERSION, **state}, p)
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_json(
        root / LATEST_FILE, {"format_version": FORMAT_VERSION, "step": step, "dir": name}
    )
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint_dir(run_dir: Path) -> Path | None:
    """The folder ``latest.json`` points to, or None when the run has no checkpoint."""
    latest = Path(run_dir) / "checkpoints" / LATEST_FILE
    if not latest.exists():
        return None
    try:
        info = json.loads(latest.read_text(encoding="utf-8"))
        folder = latest.parent / info["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{latest}: corrupt checkpoint index ({e})") from e
    if info.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{latest}: written by a newer moelab (format {info['format_version']})"
        )
    return folder


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """Load the latest checkpoint of ``run_dir`` (None when there is none).

    Raises:
        CheckpointError: the checkpoint is corrupt, truncated or from a newer format.
    """
    folder = latest_checkpoint_dir(run_dir)
    if folder is None:
        return None
    if (folder / "layout.json").exists():
        raise CheckpointError(
            f"{folder}: a sharded (DCP) checkpoint of an expert-parallel run; resume it under "
            "torchrun with --expert-parallel (or --fsdp), or convert it with `moelab consolidate`"
        )
    model = load_model(folder)
    path = folder / STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except Exception as e:  # torch raises several types for truncated/corrupt pickles
        raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__})") from e
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written by a newer moelab (format {state['format_version']})"
        )
    return Checkpoint(model=model, state=state, step=int(state["step"]))
