"""Batched rollouts: step many MiniGrid environments together with one policy forward.

Every slot ``(task, seed)`` runs one episode from ``reset(seed=seed)`` to its end; the live
environments are stepped together, one batched policy call per time step. Steps come back
grouped by episode (an episode's steps contiguous, in order), as the advantage estimators and
the switching cost need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moelab.core.routers.phase import sample_experts
from moelab.methods.rl.envs import EnvPool, TaskMix, anchor_key, door_phase
from moelab.methods.rl.policy import MiniGridPolicy


@dataclass
class Rollout:
    """Steps ``[T, ...]`` (episode-major) and episodes ``[N]``.

    Step fields: ``image [T, 7, 7, 3]``, ``direction``, ``mission [T, M]``, ``history
    [T, h, H]`` (trunk features of the last h steps, this one last; empty unless kept),
    ``action``, ``logp`` (behaviour log-prob), ``expert``, ``router_logp`` (log-prob of the
    phase router's choice, 0 where it made none), ``router_step`` (bool: the router chose here),
    ``value``, ``reward``, ``terminal``, ``episode``, ``start`` (bool: first step), ``anchor``
    (GiGPO anchor id, unique across slots' groups), ``phase`` (ground-truth DoorKey phase, −1
    without a door). Episode fields: ``task``, ``group`` (slot group id), ``ret`` (return),
    ``success``, ``length``.
    """

    image: Tensor
    direction: Tensor
    mission: Tensor
    history: Tensor
    action: Tensor
    logp: Tensor
    expert: Tensor
    router_logp: Tensor
    router_step: Tensor
    value: Tensor
    reward: Tensor
    terminal: Tensor
    episode: Tensor
    start: Tensor
    anchor: Tensor
    phase: Tensor
    task: Tensor
    group: Tensor
    ret: Tensor
    success: Tensor
    length: Tensor

    @property
    def frames(self) -> int:
        return int(self.action.shape[0])


def _obs(obs: dict, mix: TaskMix) -> tuple[np.ndarray, int, np.ndarray]:
    return obs["image"].astype(np.int64), int(obs["direction"]), mix.encode_mission(obs["mission"])


@torch.no_grad()
def collect(
    policy: MiniGridPolicy,
    mix: TaskMix,
    pool: EnvPool,
    slots: Sequence[tuple[int, int]],
    groups: Sequence[int],
    *,
    history: int,
    greedy: bool,
    tau: float = 1.0,
    keep_history: bool = True,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Run one episode per slot with ``policy``.

    Args:
        slots: ``(task index, env seed)`` per episode.
        groups: an instance-group id per slot (GiGPO groups; anchors are keyed by it).
        history: the phase router's window h.
        greedy: argmax actions and argmax routing (evaluation) instead of sampling.
        tau: the phase router's temperature.
        keep_history: store the router's history per step (training needs it).
        generator: the torch generator for action and expert sampling.
    """
    was_training = policy.training
    policy.eval()
    n = len(slots)
    envs = pool.take(slots)
    H = policy.trunk[-2].out_features
    hist = torch.zeros(n, history, H)
    expert = torch.zeros(n, dtype=torch.long)
    obs = [
        _obs(env.reset(seed=int(seed))[0], mix) for env, (_, seed) in zip(envs, slots, strict=True)
    ]
    alive = np.ones(n, dtype=bool)
    t_of = np.zeros(n, dtype=np.int64)
    steps: list[list[dict]] = [[] for _ in range(n)]
    anchors: dict[tuple, int] = {}
    arm = policy.arm
    while alive.any():
        idx = np.flatnonzero(alive)
        image = torch.from_numpy(np.stack([obs[i][0] for i in idx]))
        direction = torch.tensor([obs[i][1] for i in idx])
        mission = torch.from_numpy(np.stack([obs[i][2] for i in idx]))
        h, cells, words, mask = policy.encode(image, direction, mission)
        hist[idx] = torch.cat([hist[idx, 1:], h[:, None]], dim=1)
        r_logits = None
        chose = torch.zeros(len(idx), dtype=torch.bool)
        r_logp = torch.zeros(len(idx))
        if policy.router is not None:
            r_logits = policy.router_logits(cells, words, mask, hist[idx])
            e, lp = sample_experts(r_logits, tau, greedy=greedy, generator=generator)
            chose = torch.ones(len(idx), dtype=torch.bool)
            if arm == "trajectory":
                chose = torch.from_numpy(t_of[idx] == 0)
                e = torch.where(chose, e, expert[idx])
            expert[idx] = e
            r_logp = torch.where(chose, lp, r_logp)
            forced = e
        elif arm == "single":
            forced = torch.zeros(len(idx), dtype=torch.long)
        else:
            forced = None
        logits, out = policy.head(h, forced, r_logits)
        if forced is None:
            expert[idx] = out.plan.expert_idx
        logp_all = torch.log_softmax(logits, -1)
        if greedy:
            action = logp_all.argmax(-1)
        else:
            action = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
        logp = logp_all.gather(-1, action[:, None]).squeeze(-1)
        value = policy.value_of(h)
        for j, i in enumerate(idx):
            env = envs[i]
            key = (int(groups[i]), *anchor_key(env))
            rec = {
                "image": obs[i][0],
                "direction": obs[i][1],
                "mission": obs[i][2],
                "action": int(action[j]),
                "logp": float(logp[j]),
                "expert": int(expert[i]),
                "router_logp": float(r_logp[j]),
                "router_step": bool(chose[j]),
                "value": float(value[j]),
                "anchor": anchors.setdefault(key, len(anchors)),
                "phase": door_phase(env),
            }
            if keep_history:
                rec["history"] = hist[i].clone()
            o, reward, term, trunc, _ = env.step(int(action[j]))
            rec["reward"] = float(reward)
            rec["terminal"] = bool(term)
            steps[i].append(rec)
            t_of[i] += 1
            if term or trunc:
                alive[i] = False
            else:
                obs[i] = _obs(o, mix)
    policy.train(was_training)
    return _pack(steps, slots, groups, policy.num_experts, history, H, keep_history)


def _pack(steps, slots, groups, E, history, H, keep_history) -> Rollout:
    flat = [s for ep in steps for s in ep]
    lengths = torch.tensor([len(ep) for ep in steps])
    episode = torch.repeat_interleave(torch.arange(len(steps)), lengths)
    start = torch.zeros(len(flat), dtype=torch.bool)
    start[torch.cumsum(lengths, 0) - lengths] = True
    reward = torch.tensor([s["reward"] for s in flat], dtype=torch.float32)
    ret = torch.zeros(len(steps)).index_add_(0, episode, reward)

    def col(name, dtype):
        return torch.tensor([s[name] for s in flat], dtype=dtype)

    hist = (
        torch.stack([s["history"] for s in flat]) if keep_history else torch.zeros(len(flat), 0, H)
    )
    return Rollout(
        image=torch.from_numpy(np.stack([s["image"] for s in flat])),
        direction=col("direction", torch.long),
        mission=torch.from_numpy(np.stack([s["mission"] for s in flat])),
        history=hist,
        action=col("action", torch.long),
        logp=col("logp", torch.float32),
        expert=col("expert", torch.long),
        router_logp=col("router_logp", torch.float32),
        router_step=col("router_step", torch.bool),
        value=col("value", torch.float32),
        reward=reward,
        terminal=col("terminal", torch.bool),
        episode=episode,
        start=start,
        anchor=col("anchor", torch.long),
        phase=col("phase", torch.long),
        task=torch.tensor([t for t, _ in slots]),
        group=torch.tensor(list(groups)),
        ret=ret,
        success=ret > 0,
        length=lengths,
    )
