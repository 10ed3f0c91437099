"""MiniGrid task mixes: environment pools, observation encoding, anchor states and phases.

MiniGrid (``minigrid`` + ``gymnasium``; ``minigrid`` imports ``pygame`` at import time, so the
``rl`` extra declares ``pygame-ce``) gives a 7×7×3 egocentric view (object, colour, state ids),
the agent's direction and a mission string, with one action space (7 actions) across tasks.

A rollout slot is a ``(task, seed)`` pair: ``reset(seed=seed)`` fixes the layout (gymnasium
seeding), so the rollouts of one group share an instance, as GiGPO's groups need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moelab.errors import InvalidValueError, MissingDependencyError

RL_INSTALL = "pip install 'moelab[rl]'  (gymnasium, minigrid, pygame-ce)"
NUM_ACTIONS = 7
VIEW = 7
# minigrid.core.constants: 11 object kinds, 6 colours, 3 door states
NUM_OBJECTS, NUM_COLOURS, NUM_STATES = 11, 6, 3
GOAL_PHASES = ("find key", "open door", "reach goal")


def _gym():
    try:
        import gymnasium
        import minigrid  # noqa: F401  (registers the MiniGrid environments)
    except ImportError as e:
        raise MissingDependencyError(
            f"MiniGrid RL needs {e.name}; install with: {RL_INSTALL}"
        ) from None
    return gymnasium


def make_env(name: str, max_steps: int = 0):
    """``gymnasium.make(name)`` for a registered MiniGrid/BabyAI id; ``max_steps`` > 0 caps
    its episodes at that many steps (0: the task's own limit).

    Raises:
        MissingDependencyError: gymnasium, minigrid or pygame is not installed.
        InvalidValueError: ``name`` is not a registered environment.
    """
    gym = _gym()
    try:
        return gym.make(name, **({"max_steps": max_steps} if max_steps else {}))
    except gym.error.Error as e:
        raise InvalidValueError(f"task {name!r}: not a registered environment ({e})") from None


def _door(env):
    """The door object of a MiniGrid layout, or None (DoorKey has exactly one)."""
    for cell in env.unwrapped.grid.grid:
        if cell is not None and cell.type == "door":
            return cell
    return None


def anchor_key(env) -> tuple:
    """GiGPO's anchor state of a MiniGrid env: (agent position, direction, carried object,
    door state). Two steps of one instance with equal keys share a step-level group."""
    u = env.unwrapped
    carrying = None if u.carrying is None else u.carrying.type
    door = _door(env)
    door_state = None if door is None else (door.is_open, door.is_locked)
    return (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir), carrying, door_state)


def door_phase(env) -> int:
    """Ground-truth DoorKey phase, for evaluation only [I]: 0 before the key is held with the
    door still locked, 1 holding the key with the door locked, 2 once the door is unlocked;
    -1 for a layout without a door."""
    door = _door(env)
    if door is None:
        return -1
    if not door.is_locked:
        return 2
    carrying = env.unwrapped.carrying
    return 1 if carrying is not None and carrying.type == "key" else 0


@dataclass(frozen=True)
class TaskMix:
    """Tasks, their sampling weights and the mission vocabulary.

    Attributes:
        names: gymnasium ids.
        weights: sampling probabilities (sum 1).
        vocab: mission words → ids from 1 (0 pads).
        mission_len: M, the longest mission in words.
        max_steps: episode cap (0: each task's own limit).
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    vocab: dict[str, int]
    mission_len: int
    max_steps: int = 0

    @classmethod
    def build(cls, names: Sequence[str], weights: Sequence[float], max_steps: int = 0) -> TaskMix:
        """Check the mix and read each task's mission once (a reset with seed 0).

        Raises:
            InvalidValueError: empty or duplicate names, weights not one per task, negative or
                not summing to 1, an unknown task.
            MissingDependencyError: the ``rl`` extra is missing.
        """
        names, weights = tuple(names), tuple(float(w) for w in weights)
        if not names or len(set(names)) != len(names):
            raise InvalidValueError(f"tasks: must be distinct and non-empty, got {names!r}")
        if len(weights) != len(names) or any(w < 0 for w in weights):
            raise InvalidValueError(
                f"task_weights: need one weight >= 0 per task ({len(names)}), got {weights!r}"
            )
        if abs(sum(weights) - 1.0) > 1e-6:
            raise InvalidValueError(f"task_weights: must sum to 1, got {sum(weights)}")
        words: list[str] = []
        longest = 0
        for name in names:
            env = make_env(name)
            obs, _ = env.reset(seed=0)
            if env.action_space.n != NUM_ACTIONS or obs["image"].shape != (VIEW, VIEW, 3):
                raise InvalidValueError(f"task {name!r}: not a MiniGrid task (7 actions, 7x7 view)")
            mission = obs["mission"].split()
            longest = max(longest, len(mission))
            words += [w for w in mission if w not in words]
            env.close()
        vocab = {w: i + 1 for i, w in enumerate(sorted(words))}
        return cls(names, weights, vocab, longest, max_steps)

    def encode_mission(self, mission: str) -> np.ndarray:
        """``[M]`` int64 word ids, zero-padded; unknown words map to 0 (padding)."""
        ids = np.zeros(self.mission_len, dtype=np.int64)
        for k, w in enumerate(mission.split()[: self.mission_len]):
            ids[k] = self.vocab.get(w, 0)
        return ids


class EnvPool:
    """Reusable environments per task (creating a gymnasium env costs more than a reset)."""

    def __init__(self, mix: TaskMix) -> None:
        self.mix = mix
        self._free: dict[int, list] = {t: [] for t in range(len(mix.names))}

    def take(self, slots: Sequence[tuple[int, int]]) -> list:
        """One env per ``(task index, seed)`` slot, not yet reset."""
        out, used = [], {t: 0 for t in self._free}
        for task, _ in slots:
            pool = self._free[task]
            if used[task] == len(pool):
                pool.append(make_env(self.mix.names[task], self.mix.max_steps))
            out.append(pool[used[task]])
            used[task] += 1
        return out
