"""A continual learner mid-stream as a folder: ``continual.json`` (format, config, seed, tasks
learned, the accuracy rows so far) and ``state.safetensors`` (the learner's trainable parts:
adapters, routers, heads, prototypes, class Gaussians; the frozen encoder is not stored).

:func:`load_learner` rebuilds the stream from the config and seed (same data, same class
order and split), grows a fresh learner to the saved number of tasks and loads the state, so
its predictions equal the saved learner's and :func:`~moelab.methods.continual.loop.run_stream`
can go on from the next task.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from moelab.errors import InvalidValueError, UserError
from moelab.methods.continual.config import ContinualConfig
from moelab.methods.continual.learner import Learner
from moelab.utils.atomic import atomic_write_bytes, atomic_write_json, write_folder_atomically
from moelab.utils.jsonfile import read_json

FORMAT = "moelab.continual/1"
META_FILE = "continual.json"
STATE_FILE = "state.safetensors"


class ContinualRunError(UserError, ValueError):
    """A continual run folder is missing, of another format, or does not fit its config."""


def save_learner(
    learner: Learner, seed: int, out: str | Path, R: np.ndarray | None = None, *, overwrite=False
) -> Path:
    """Write ``learner`` (after ``learner.tasks_learned`` tasks) to the folder ``out``
    atomically; ``R`` the accuracy matrix so far (rows of the learned tasks are kept)."""
    state = {k: v.detach().contiguous() for k, v in learner.state_dict().items()}
    n = learner.tasks_learned
    rows = None
    if R is not None:
        rows = [[None if np.isnan(x) else float(x) for x in R[t]] for t in range(n)]
    meta = {
        "format": FORMAT,
        "seed": seed,
        "tasks_learned": n,
        "stream_tasks": learner.stream.num_tasks,
        "config": dataclasses.asdict(learner.config),
        "R": rows,
    }

    def fill(tmp: Path) -> None:
        atomic_write_bytes(tmp / STATE_FILE, save_safetensors(state))
        atomic_write_json(tmp / META_FILE, meta)

    write_folder_atomically(out, fill, overwrite, known_outputs=(META_FILE, STATE_FILE))
    return Path(out)


def read_run(folder: str | Path) -> tuple[ContinualConfig, int, int, np.ndarray | None]:
    """``(config, seed, tasks learned, R or None)`` of a saved run; R is ``[T, T]`` for the
    stream's T tasks, NaN where not tested or not yet learned.

    Raises:
        ContinualRunError: no run there, another format, or a bad config.
    """
    folder = Path(folder)
    meta = read_json(folder / META_FILE, ContinualRunError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ContinualRunError(f"{folder / META_FILE}: not a {FORMAT} file")
    try:
        config = ContinualConfig(**dict(meta["config"]))
    except (InvalidValueError, TypeError, KeyError) as e:
        raise ContinualRunError(f"{folder / META_FILE}: bad config ({e})") from None
    seed, n = meta.get("seed"), meta.get("tasks_learned")
    # a domain stream has one task per domain, whatever config.num_tasks says (older files
    # lack the count: their streams were class-incremental)
    T = meta.get("stream_tasks", config.num_tasks)
    if not isinstance(T, int) or T < 1:
        raise ContinualRunError(f"{folder / META_FILE}: bad stream_tasks")
    if not isinstance(seed, int) or not isinstance(n, int) or not 0 <= n <= T:
        raise ContinualRunError(f"{folder / META_FILE}: bad seed or tasks_learned")
    R = None
    if meta.get("R") is not None:
        R = np.full((T, T), np.nan)
        rows = meta["R"]
        if len(rows) > T or any(len(row) > T for row in rows):
            raise ContinualRunError(f"{folder / META_FILE}: R is larger than {T} tasks")
        for t, row in enumerate(rows):  # a run stopped early saved the columns it had
            R[t, : len(row)] = [np.nan if x is None else x for x in row]
    return config, seed, n, R


def load_learner(folder: str | Path, learner: Learner) -> None:
    """Load the state in ``folder`` into ``learner``, a fresh learner built from the saved
    config and seed (e.g. ``ContinualRecipe.learner(config, seed)``).

    Raises:
        ContinualRunError: the folder does not fit the learner.
    """
    folder = Path(folder)
    _, _, n, _ = read_run(folder)
    learner.grow_to(n)
    try:
        learner.load_state_dict(load_safetensors((folder / STATE_FILE).read_bytes()))
    except FileNotFoundError:
        raise ContinualRunError(f"{folder}: no {STATE_FILE}") from None
    except (RuntimeError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ContinualRunError(
            f"{folder / STATE_FILE}: does not fit its config ({first})"
        ) from None
    learner.tasks_learned = n
