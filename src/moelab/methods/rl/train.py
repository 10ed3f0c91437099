"""Training a MiniGrid policy arm: rollouts in instance groups, advantages, PPO updates,
greedy evaluation on held-out seeds, checkpoint and resume.

One iteration: ``groups`` task instances (a task drawn by ``task_weights`` and a training
seed each) × ``group_size`` rollouts from the same ``reset(seed)``; advantages (GiGPO, GRPO or
GAE); ``epochs`` passes of shuffled minibatches of ``minibatch`` steps. The routers' own
objectives ride on the same minibatches: REINFORCE on the step-level advantage with the
switching cost (``pamoe``; ``trajectory`` at each episode's first step only), the
``Σ(f̄ − 1/E)²`` balance loss and the diversity loss (:mod:`moelab.core.losses.phase`).
Training seeds are drawn below ``EVAL_SEED_BASE``; evaluation uses the seeds from it on.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from moelab.core.losses.phase import (
    expert_diversity_loss,
    reinforce_loss,
    switch_shaped_advantages,
    uniform_balance_loss,
)
from moelab.core.routers.phase import linear_temperature
from moelab.errors import TrainingDivergedError
from moelab.methods.rl.advantages import gae_advantages, gigpo_advantages
from moelab.methods.rl.config import RLConfig
from moelab.methods.rl.envs import EnvPool, TaskMix
from moelab.methods.rl.metrics import rollout_metrics, task_short
from moelab.methods.rl.policy import MiniGridPolicy
from moelab.methods.rl.ppo import k3_kl, ppo_clip_loss
from moelab.methods.rl.rollout import Rollout, collect
from moelab.train.progress import TrainProgress

EVAL_SEED_BASE = 1_000_000_000


@dataclass
class RLRun:
    """A trained arm: its settings, seed, task mix, policy and learning curve.

    Attributes:
        curve: ``{frames: {metric: value}}`` of each greedy evaluation, in order.
        frames: environment steps trained on.
        updates: optimizer steps taken.
    """

    config: RLConfig
    seed: int
    mix: TaskMix
    policy: MiniGridPolicy
    curve: dict[int, dict[str, float]] = field(default_factory=dict)
    frames: int = 0
    updates: int = 0


def build_run(config: RLConfig, seed: int) -> RLRun:
    """A fresh run: the task mix and an initial policy seeded by ``seed``."""
    mix = TaskMix.build(config.tasks, config.task_weights, config.max_steps)
    torch.manual_seed(seed)
    return RLRun(config, seed, mix, MiniGridPolicy(config, len(mix.vocab) + 1))


def evaluate(
    run: RLRun, episodes: int | None = None, pool: EnvPool | None = None
) -> dict[str, float]:
    """Greedy success and routing metrics on ``episodes`` held-out seeds per task
    (:func:`~moelab.methods.rl.metrics.rollout_metrics`)."""
    n = episodes or run.config.eval_episodes
    slots = [(t, EVAL_SEED_BASE + k) for t in range(len(run.mix.names)) for k in range(n)]
    r = collect(
        run.policy,
        run.mix,
        pool or EnvPool(run.mix),
        slots,
        list(range(len(slots))),
        history=run.config.history,
        greedy=True,
        keep_history=False,
    )
    return rollout_metrics(r, run.mix.names, run.policy.num_experts)


def _draw_slots(config: RLConfig, gen: torch.Generator) -> tuple[list, list]:
    weights = torch.tensor(config.task_weights, dtype=torch.float64)
    tasks = torch.multinomial(weights, config.groups, replacement=True, generator=gen)
    seeds = torch.randint(0, EVAL_SEED_BASE, (config.groups,), generator=gen)
    slots, groups = [], []
    for g in range(config.groups):
        slots += [(int(tasks[g]), int(seeds[g]))] * config.group_size
        groups += [g] * config.group_size
    return slots, groups


def _advantages(config: RLConfig, r: Rollout) -> tuple[Tensor, Tensor | None]:
    """Per-step advantages and (GAE only) value targets."""
    if config.estimator == "gae":
        return gae_advantages(
            r.reward, r.value, r.episode, r.terminal, config.gamma, config.gae_lambda
        )
    weight = config.step_weight if config.estimator == "gigpo" else 0.0
    adv = gigpo_advantages(
        r.reward,
        r.episode,
        r.group,
        r.anchor,
        gamma=config.gamma,
        step_weight=weight,
        norm=config.norm,
    )
    return adv, None


def _total_updates(config: RLConfig) -> int:
    return config.epochs * math.ceil(config.frames / config.minibatch)


class _Updater:
    """The optimizer, the frozen reference policy and one minibatch loss."""

    def __init__(self, run: RLRun) -> None:
        self.run = run
        cfg = run.config
        self.ref = copy.deepcopy(run.policy).requires_grad_(False).eval()
        router = [p for n, p in run.policy.named_parameters() if n.startswith("router.")]
        rest = [p for n, p in run.policy.named_parameters() if not n.startswith("router.")]
        groups = [{"params": rest, "lr": cfg.lr}]
        if router:
            groups.append({"params": router, "lr": cfg.router_lr})
        self.opt = torch.optim.Adam(groups, lr=cfg.lr)
        self.tau_steps = cfg.tau_steps or _total_updates(cfg)

    def tau(self) -> float:
        cfg = self.run.config
        return linear_temperature(self.run.updates, cfg.tau_start, cfg.tau_end, self.tau_steps)

    def loss(self, r: Rollout, mb: Tensor, adv: Tensor, router_adv: Tensor, targets) -> Tensor:
        cfg, policy = self.run.config, self.run.policy
        image, direction, mission = r.image[mb], r.direction[mb], r.mission[mb]
        h, cells, words, mask = policy.encode(image, direction, mission)
        r_logits = None
        if policy.router is not None:
            r_logits = policy.router_logits(cells, words, mask, r.history[mb])
        forced = None if cfg.arm == "step" else r.expert[mb]
        logits, out = policy.head(h, forced, r_logits)
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, r.action[mb, None]).squeeze(-1)
        with torch.no_grad():
            hr, *_ = self.ref.encode(image, direction, mission)
            ref_logits, _ = self.ref.head(hr, forced)
            ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, r.action[mb, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        loss = (
            ppo_clip_loss(logp, r.logp[mb], adv[mb], cfg.clip)
            + cfg.kl_coef * k3_kl(logp, ref_logp)
            - cfg.entropy_coef * entropy
        )
        loss = loss + sum(out.aux_losses.values(), torch.zeros(()))
        if targets is not None:
            loss = loss + cfg.value_coef * (policy.value_of(h) - targets[mb]).pow(2).mean()
        if r_logits is not None:
            loss = loss + self._router_loss(r, mb, h, r_logits, router_adv)
        return loss

    def _router_loss(self, r: Rollout, mb: Tensor, h: Tensor, r_logits: Tensor, adv: Tensor):
        cfg, policy = self.run.config, self.run.policy
        logp_r = torch.log_softmax(r_logits / self.tau(), -1)
        probs = logp_r.exp()
        chosen = logp_r.gather(-1, r.expert[mb, None]).squeeze(-1)
        sel = r.router_step[mb]
        loss = cfg.balance_coef * uniform_balance_loss(probs)
        if bool(sel.any()):
            loss = loss + reinforce_loss(chosen[sel], adv[mb][sel])
        if cfg.diversity_coef > 0:
            each = [
                torch.log_softmax(policy.head(h, torch.full_like(mb, e))[0], -1)
                for e in range(policy.num_experts)
            ]
            div = expert_diversity_loss(torch.stack(each), probs, cfg.diversity_threshold)
            loss = loss + cfg.diversity_coef * div
        return loss

    def update(self, r: Rollout, gen: torch.Generator) -> float:
        cfg, policy = self.run.config, self.run.policy
        adv, targets = _advantages(cfg, r)
        router_adv = adv
        if cfg.arm == "pamoe":
            router_adv = switch_shaped_advantages(adv, r.expert, r.start, cfg.switch_cost)
        policy.train()
        last = 0.0
        for _ in range(cfg.epochs):
            order = torch.randperm(r.frames, generator=gen)
            for mb in order.split(cfg.minibatch):
                loss = self.loss(r, mb, adv, router_adv, targets)
                if not torch.isfinite(loss):
                    raise TrainingDivergedError(
                        f"PPO loss is {loss.item()} after {self.run.frames} frames; lower lr"
                    )
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
                self.opt.step()
                self.run.updates += 1
                last = loss.item()
        policy.eval()
        return last


def _eval_point(run: RLRun, pool: EnvPool, final: bool) -> None:
    episodes = run.config.final_episodes if final else run.config.eval_episodes
    run.curve[run.frames] = evaluate(run, episodes, pool)


def train_policy(
    config: RLConfig,
    seed: int,
    *,
    checkpoint: str | Path | None = None,
    progress: bool = False,
) -> RLRun:
    """Train one arm for ``config.frames`` environment steps and evaluate it greedily every
    ``eval_every`` frames on ``eval_episodes`` held-out seeds per task, and at the end on
    ``final_episodes`` (the last curve point is the final evaluation).

    Args:
        checkpoint: a file to save the training state to after every evaluation; if it exists,
            training resumes from it (same config and seed required).
        progress: show a progress bar (frames, DoorKey success, frames/s).
    Raises:
        TrainingDivergedError: a non-finite loss.
        CheckpointError: the checkpoint is unreadable or belongs to another run.
        MissingDependencyError: the ``rl`` extra is missing.
    """
    from moelab.methods.rl.io import load_checkpoint, save_checkpoint

    run = build_run(config, seed)
    updater = _Updater(run)
    gen = torch.Generator().manual_seed(seed)
    if checkpoint is not None and Path(checkpoint).exists():
        load_checkpoint(checkpoint, run, updater.opt, updater.ref, gen)
    pool = EnvPool(run.mix)
    complex_key = f"success/{task_short(config.tasks[-1])}"
    next_eval = (run.frames // config.eval_every + 1) * config.eval_every
    with TrainProgress(config.frames, enabled=progress, start=run.frames) as bar:
        while run.frames < config.frames:
            slots, groups = _draw_slots(config, gen)
            r = collect(
                run.policy,
                run.mix,
                pool,
                slots,
                groups,
                history=config.history,
                greedy=False,
                tau=updater.tau(),
                generator=gen,
            )
            run.frames += r.frames
            loss = updater.update(r, gen)
            done = run.frames >= config.frames
            if run.frames >= next_eval or done:
                _eval_point(run, pool, final=done)
                next_eval = (run.frames // config.eval_every + 1) * config.eval_every
                if checkpoint is not None:
                    save_checkpoint(checkpoint, run, updater.opt, updater.ref, gen)
            last = run.curve[max(run.curve)] if run.curve else {}
            bar.update(
                min(run.frames, config.frames),
                loss=loss,
                aux=float(r.success.float().mean()),
                val=last.get(complex_key, math.nan),
            )
    return run


def frames_to_target(curve: dict[int, dict[str, float]], key: str, target: float) -> int | None:
    """The first evaluated frame count at which ``curve[frames][key] >= target`` (None if never)."""
    for frames in sorted(curve):
        if curve[frames].get(key, -1.0) >= target:
            return frames
    return None


def run_metrics(run: RLRun) -> dict[str, float]:
    """The final evaluation, frames to ``success_target`` on the complex task (censored at the
    budget: ``reached_target`` says whether it was reached), the area under that task's
    success curve (trapezoid over frames, divided by the frames), and the curve itself as
    ``curve/<task>/<k>`` at the evaluation points ``k·eval_every`` (the point nearest after)."""
    cfg = run.config
    final = run.curve[max(run.curve)]
    key = f"success/{task_short(cfg.tasks[-1])}"
    hit = frames_to_target(run.curve, key, cfg.success_target)
    out = dict(final)
    out["frames_to_target"] = float(hit if hit is not None else run.frames)
    out["reached_target"] = float(hit is not None)
    xs = [0, *sorted(run.curve)]
    ys = [0.0, *(run.curve[f][key] for f in sorted(run.curve))]
    area = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))
    out["auc"] = area / xs[-1]
    points = sorted(run.curve)
    for k in range(1, cfg.frames // cfg.eval_every + 1):
        at = next((f for f in points if f >= k * cfg.eval_every), points[-1])
        for name in (task_short(t) for t in cfg.tasks):
            out[f"curve/{name}/{k * cfg.eval_every}"] = run.curve[at][f"success/{name}"]
    return out
