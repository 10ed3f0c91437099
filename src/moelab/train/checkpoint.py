"""Training checkpoints: model folder + optimizer/RNG/data-order state, written atomically.

Layout inside a run folder::

    checkpoints/step-000200/   config.json, model.safetensors, manifest.json (moelab.models.io)
                               trainer_state.pt (optimizer, step, RNG and batch-sampler state)
    checkpoints/latest.json    {"format_version": 1, "step": 200, "dir": "step-000200"}

A checkpoint folder is filled under a temporary name and renamed into place; ``latest.json``
is replaced atomically afterwards, so an interrupted write never becomes a checkpoint.

Resuming does not trust ``latest.json`` alone: :func:`load_checkpoint` tries every
``step-NNNNNN`` folder newest first and takes the first that verifies (checksums, trainer
state), warning about each one it skips, so a missing or corrupt ``latest.json`` or a
corrupt newest checkpoint falls back to the next one. Rotation keeps the :data:`KEEP` newest
checkpoints at or below the step just saved and never deletes one with a higher step (after
a fall-back those are the user's to inspect). Only real folders named ``step-NNNNNN`` are
ever read or deleted; symlinks (and a ``checkpoints`` folder that is a symlink) are refused,
so rotation cannot delete anything outside the run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moelab.models import CheckpointError, MoETransformer, load_model, save_model
from moelab.utils.atomic import atomic_write, atomic_write_json, fsync_dir
from moelab.utils.paths import UnsafePathError, confined, refuse_symlink

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest.json"
KEEP = 2
STATE_KEYS = frozenset({"step", "optimizer", "torch_rng", "generator", "tokens_seen", "elapsed_s"})
_STEP_DIR = re.compile(r"step-(\d{6,})")


class ResumeWarning(UserWarning):
    """A checkpoint was skipped while looking for the newest valid one."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model, the trainer state dict saved with it, and the
    newer checkpoints that were skipped (one message each)."""

    model: MoETransformer
    state: dict[str, Any]
    step: int
    folder: Path | None = None
    skipped: list[str] = field(default_factory=list)


def _root(run_dir: Path) -> Path:
    root = Path(run_dir) / "checkpoints"
    try:
        refuse_symlink(root, what="checkpoints folder")
    except UnsafePathError as e:
        raise CheckpointError(str(e)) from e
    return root


def checkpoint_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every real ``checkpoints/step-NNNNNN`` folder, oldest first."""
    root = _root(Path(run_dir))
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _remove(path: Path) -> None:
    """Delete a folder moelab wrote (a symlink in its place is unlinked, never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def save_checkpoint(run_dir: Path, model: MoETransformer, state: dict[str, Any], step: int) -> Path:
    """Write ``model`` and ``state`` (tensors, numbers, nested dicts) as the checkpoint of ``step``.

    Raises:
        DiskFullError: the disk filled up; the partial checkpoint is removed, older ones stay.
        CheckpointError: ``checkpoints`` is a symlink.
    """
    root = _root(Path(run_dir))
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    _remove(tmp)
    try:
        save_model(model, tmp)
        atomic_write(
            tmp / STATE_FILE, lambda p: torch.save({"format_version": FORMAT_VERSION, **state}, p)
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_json(
        root / LATEST_FILE, {"format_version": FORMAT_VERSION, "step": step, "dir": name}
    )
    older = [p for s, p in checkpoint_dirs(run_dir) if s < step]
    for old in older[: max(0, len(older) - (KEEP - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint_dir(run_dir: Path) -> Path | None:
    """The folder ``latest.json`` points to, or None when there is no ``latest.json``.

    Raises:
        CheckpointError: corrupt, from a newer format, or pointing outside ``checkpoints``.
    """
    root = _root(Path(run_dir))
    latest = root / LATEST_FILE
    if not latest.exists():
        return None
    try:
        info = json.loads(latest.read_text(encoding="utf-8"))
        name = info["dir"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{latest}: corrupt checkpoint index ({e})") from e
    v = info.get("format_version", 0)
    if not isinstance(v, int) or v > FORMAT_VERSION:
        raise CheckpointError(f"{latest}: written by a newer moelab (format {v!r})")
    try:
        return confined(root, name, what=f"{LATEST_FILE} entry")
    except UnsafePathError as e:
        raise CheckpointError(str(e)) from e


def _load_one(folder: Path, step: int) -> Checkpoint:
    model = load_model(folder)
    path = folder / STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except Exception as e:  # torch raises several types for truncated/corrupt pickles
        raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__})") from e
    if not isinstance(state, dict) or not set(state) >= STATE_KEYS:
        missing = sorted(STATE_KEYS - set(state)) if isinstance(state, dict) else "all"
        raise CheckpointError(f"{path}: not a trainer state (missing {missing})")
    v = state.get("format_version", 0)
    if not isinstance(v, int) or v > FORMAT_VERSION:
        raise CheckpointError(f"{path}: written by a newer moelab (format {v!r})")
    if state["step"] != step:
        raise CheckpointError(f"{path}: holds step {state['step']!r}, the folder says {step}")
    return Checkpoint(model=model, state=state, step=step, folder=folder)


def load_checkpoint(run_dir: Path) -> Checkpoint | None:
    """Load the newest valid checkpoint of ``run_dir`` (None when it has none at all).

    Every ``step-NNNNNN`` folder is tried newest first; each one that fails to verify is
    skipped with a :class:`ResumeWarning` (and listed in :attr:`Checkpoint.skipped`).
    ``latest.json`` is checked (a corrupt or escaping one is reported) but not needed.

    Raises:
        CheckpointError: checkpoints exist but none is valid (the newest one's error is
            quoted), or ``checkpoints`` is a symlink.
    """
    skipped = []
    try:
        latest_checkpoint_dir(run_dir)
    except CheckpointError as e:
        skipped.append(f"ignored {e}")
    for step, folder in reversed(checkpoint_dirs(run_dir)):
        if (folder / "layout.json").exists():
            raise CheckpointError(
                f"{folder}: a sharded (DCP) checkpoint of an expert-parallel run; resume it under "
                "torchrun with --expert-parallel (or --fsdp), or convert it with `moelab consolidate`"
            )
        try:
            ckpt = _load_one(folder, step)
        except CheckpointError as e:
            skipped.append(f"skipped checkpoint {folder.name}: {e}")
            continue
        for msg in skipped:
            warnings.warn(msg, ResumeWarning, stacklevel=2)
        ckpt.skipped = skipped
        return ckpt
    tried = [s for s in skipped if s.startswith("skipped")]
    if tried:
        raise CheckpointError(
            f"{Path(run_dir) / 'checkpoints'}: no valid checkpoint ({len(tried)} tried; newest: "
            f"{tried[0].split(': ', 1)[1]})"
        )
    return None
