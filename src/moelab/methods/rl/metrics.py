"""Evaluation metrics of a routed policy: success per task, expert switches, run lengths, and
the NMI between the chosen expert and the ground-truth phase."""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.analysis._common import nmi_from_contingency
from moelab.errors import InvalidValueError
from moelab.methods.rl.rollout import Rollout


def switches_per_episode(expert: Tensor, start: Tensor, episode: Tensor) -> Tensor:
    """Expert changes ``e_t ≠ e_{t−1}`` inside each episode, ``[N]`` float32.

    Args:
        expert, start, episode: ``[T]`` steps in episode order (``start`` True at each first
            step, ``episode`` ids 0..N−1).
    """
    if not (expert.shape == start.shape == episode.shape):
        raise InvalidValueError("expert, start, episode: must be [T] of one length")
    switched = torch.zeros_like(start)
    switched[1:] = expert[1:] != expert[:-1]
    switched &= ~start
    n = int(episode.max()) + 1 if episode.numel() else 0
    return torch.zeros(n).index_add_(0, episode, switched.float())


def expert_phase_nmi(expert: Tensor, phase: Tensor, num_experts: int, num_phases: int) -> float:
    """NMI (arithmetic normalisation, scikit-learn's convention) between expert ids and phase
    labels of the same steps; 0.0 for no steps or a single phase [I] (scikit-learn gives 1.0
    when both labelings are constant; a policy that never picks up the key has no phase
    structure to align with).

    Raises:
        InvalidValueError: shapes disagree or a label outside its range.
    """
    if expert.shape != phase.shape:
        raise InvalidValueError(
            f"expert, phase: shapes disagree: {tuple(expert.shape)}, {tuple(phase.shape)}"
        )
    if expert.numel() == 0:
        return 0.0
    if int(expert.min()) < 0 or int(expert.max()) >= num_experts:
        raise InvalidValueError(f"expert: ids must lie in [0, {num_experts})")
    if int(phase.min()) < 0 or int(phase.max()) >= num_phases:
        raise InvalidValueError(f"phase: labels must lie in [0, {num_phases})")
    if bool((phase == phase[0]).all()):
        return 0.0
    joint = torch.zeros(num_experts * num_phases).index_add_(
        0, expert * num_phases + phase, torch.ones(expert.shape[0])
    )
    return nmi_from_contingency(joint.view(num_experts, num_phases))


def task_short(name: str) -> str:
    """``"MiniGrid-DoorKey-5x5-v0"`` → ``"doorkey"`` (the second dash-separated part)."""
    parts = name.split("-")
    return (parts[1] if len(parts) > 1 else name).lower()


def rollout_metrics(r: Rollout, names: tuple[str, ...], num_experts: int) -> dict[str, float]:
    """Greedy-evaluation metrics of a rollout over the tasks ``names``: ``success/<task>``,
    ``return/<task>``, ``switches/<task>`` and ``run_length/<task>`` (mean steps per
    constant-expert run), overall ``switches``, and ``nmi`` on the last (complex) task's
    steps whose phase is known."""
    out: dict[str, float] = {}
    sw = switches_per_episode(r.expert, r.start, r.episode)
    for t, name in enumerate(names):
        sel = r.task == t
        if not bool(sel.any()):
            continue
        key = task_short(name)
        out[f"success/{key}"] = float(r.success[sel].float().mean())
        out[f"return/{key}"] = float(r.ret[sel].mean())
        out[f"switches/{key}"] = float(sw[sel].mean())
        out[f"run_length/{key}"] = float((r.length[sel] / (sw[sel] + 1)).mean())
    out["switches"] = float(sw.mean())
    last = len(names) - 1
    steps = (r.task[r.episode] == last) & (r.phase >= 0)
    out["nmi"] = expert_phase_nmi(r.expert[steps], r.phase[steps], num_experts, 3)
    return out


def expert_shares(r: Rollout, names: tuple[str, ...], num_experts: int) -> dict[str, list[float]]:
    """The share of each expert among the steps of each task (``<task>``) and, for the last
    (complex) task, of each ground-truth phase (``<task>/phase<k>``): ``[E]`` lists summing to 1
    (tasks or phases without steps are left out). Shows routing collapse and specialisation."""
    out: dict[str, list[float]] = {}
    step_task = r.task[r.episode]

    def share(sel: Tensor) -> list[float]:
        counts = torch.bincount(r.expert[sel], minlength=num_experts).double()
        return (counts / counts.sum()).tolist()

    for t, name in enumerate(names):
        sel = step_task == t
        if bool(sel.any()):
            out[task_short(name)] = share(sel)
    last = len(names) - 1
    for k in range(3):
        sel = (step_task == last) & (r.phase == k)
        if bool(sel.any()):
            out[f"{task_short(names[last])}/phase{k}"] = share(sel)
    return out
