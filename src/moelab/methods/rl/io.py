"""Checkpoint and resume of an RL run: one file holding the policy, the reference policy, the
optimizer, the sampling generator, frames, updates and the learning curve so far.

Written atomically (``torch.save`` to a temporary file, then rename) and read with
``weights_only=True``; a checkpoint of another config or seed is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moelab.models.io import CheckpointError
from moelab.utils.atomic import atomic_write

FORMAT = "moelab.rl-checkpoint/1"


def _config(run) -> dict:
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(run.config).items()
    }


def save_checkpoint(path, run, opt, ref, gen: torch.Generator) -> Path:
    """Write the training state of ``run`` (an :class:`~moelab.methods.rl.train.RLRun`)."""
    state = {
        "format": FORMAT,
        "config": _config(run),
        "seed": run.seed,
        "frames": run.frames,
        "updates": run.updates,
        "curve": {str(k): v for k, v in run.curve.items()},
        "policy": run.policy.state_dict(),
        "ref": ref.state_dict(),
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
    }
    return atomic_write(Path(path), lambda p: torch.save(state, p))


def checkpoint_frames(path) -> int | None:
    """The frames trained so far in the checkpoint ``path``, or None if there is none there.

    Raises:
        CheckpointError: the file is unreadable or of another format.
    """
    path = Path(path)
    if not path.is_file():
        return None
    return _read(path)["frames"]


def _read(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupt pickles
        raise CheckpointError(f"{path}: corrupt or not a checkpoint ({type(e).__name__})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} file")
    return state


def load_policy(path, run) -> dict:
    """Load the policy, frames, updates and curve of the checkpoint ``path`` into ``run`` (for
    analysis of a finished or interrupted run); returns the whole saved state.

    Raises:
        CheckpointError: unreadable, another format, or another config or seed.
    """
    path = Path(path)
    state = _read(path)
    if state["config"] != _config(run) or state["seed"] != run.seed:
        raise CheckpointError(f"{path}: written by another config or seed; use a new file")
    run.policy.load_state_dict(state["policy"])
    run.frames, run.updates = state["frames"], state["updates"]
    run.curve = {int(k): v for k, v in state["curve"].items()}
    return state


def load_checkpoint(path, run, opt, ref, gen: torch.Generator) -> None:
    """Restore ``run``, ``opt``, ``ref`` and ``gen`` from ``path`` in place (to resume).

    Raises:
        CheckpointError: unreadable, another format, or another config or seed.
    """
    state = load_policy(path, run)
    ref.load_state_dict(state["ref"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
