"""The PA-MoE recipe's settings: one dataclass for the task mix, the policy arms and training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.utils.fields import check_fields

Arm = Literal["single", "step", "trajectory", "pamoe"]
Estimator = Literal["gigpo", "grpo", "gae"]
Norm = Literal["mean_std", "mean"]

ARMS: tuple[str, ...] = ("pamoe", "single", "step", "trajectory")
EMPTY = "MiniGrid-Empty-Random-5x5-v0"
DOORKEY = "MiniGrid-DoorKey-5x5-v0"


@dataclass(frozen=True)
class RLConfig:
    """One PA-MoE run (``shared/research/wave3-agents-alignment.md`` §1.3-1.4; [C] paper code,
    [I] this project's choice).

    Task mix:
        tasks, task_weights: gymnasium ids and sampling weights (75 % Empty-Random-5x5, 25 %
            DoorKey-5x5: simple tasks dominate, as in the paper's Fig. 1 [I]). The **last** task
            is the complex one: frames to the success target and the phase NMI are measured on it.
        max_steps: episode cap (0: each task's own, 100 for Empty-5x5 and 250 for DoorKey-5x5).
        frames: environment steps of training (the budget).
        groups, group_size: task instances per iteration and rollouts per instance (8 × 8 [I]).

    Policy (all arms share the trunk) [I]:
        arm: ``"pamoe"`` (phase router), ``"single"`` (one expert with the summed width: equal
            total parameters), ``"step"`` (token-choice top-1 router per step, the token-level
            analogue), ``"trajectory"`` (the phase router at t = 0, held all episode).
        embed_size: cell/word embedding width d; hidden_size: trunk width.
        num_experts, expert_size: E routed experts of hidden width ``expert_size`` (the single
            policy: one of width ``E·expert_size``); shared_size: an always-on shared expert.
        router_size, history: phase-router width and the steps its LSTM reads (5 [C]).

    Router (``pamoe``, ``trajectory``):
        tau_start, tau_end: temperature endpoints (2.0 → 0.5 [C]); tau_steps: router updates
            over which τ falls (0 = this run's number of updates [I]; paper code 3000).
        switch_cost: λ_s, on the router's advantage per switch (0.05 [I]).
        balance_coef: ``Σ(f̄ − 1/E)²`` weight (0.001 [C]).
        diversity_coef, diversity_threshold: 0.01 and τ_div 0.1 [C].
        step_balance_coef: Switch balance loss of the ``step`` arm (0.01 [I]).

    Objective:
        estimator: ``"gigpo"`` (A^E + ω·A^S [C]), ``"grpo"`` (A^E only) or ``"gae"`` (PPO with a
            value head; the spec's fallback).
        norm: GiGPO/GRPO normalisation, ``"mean_std"`` (the script [C]) or ``"mean"``.
        step_weight: ω (1.0 [C]); gamma: γ (0.95 [C]); gae_lambda, value_coef: GAE's λ and
            value-loss weight.
        clip: PPO ε (0.2 [C]); kl_coef: k3 KL to the initial policy (0.01 [C]);
            entropy_coef: entropy bonus [I].
        epochs, minibatch, lr, router_lr, grad_clip: PPO epochs (2), minibatch steps (1024),
            Adam learning rates and global-norm clipping (1.0 [C]) [I].

    Evaluation:
        eval_every: frames between greedy evaluations (the learning curve); eval_episodes:
            held-out seeds per task (disjoint from training seeds) at each curve point;
            final_episodes: held-out seeds per task of the final evaluation (the reported
            success); success_target: the complex task's success level whose first frame
            count is reported (0.8).

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    arm: Arm = "pamoe"
    tasks: tuple[str, ...] = (EMPTY, DOORKEY)
    task_weights: tuple[float, ...] = (0.75, 0.25)
    max_steps: int = 0
    frames: int = 400_000
    groups: int = 8
    group_size: int = 8
    embed_size: int = 16
    hidden_size: int = 64
    num_experts: int = 4
    expert_size: int = 16
    shared_size: int = 64
    router_size: int = 32
    history: int = 5
    tau_start: float = 2.0
    tau_end: float = 0.5
    tau_steps: int = 0
    switch_cost: float = 0.05
    balance_coef: float = 0.001
    diversity_coef: float = 0.01
    diversity_threshold: float = 0.1
    step_balance_coef: float = 0.01
    estimator: Estimator = "gigpo"
    norm: Norm = "mean_std"
    step_weight: float = 1.0
    gamma: float = 0.95
    gae_lambda: float = 0.95
    value_coef: float = 0.5
    clip: float = 0.2
    kl_coef: float = 0.01
    entropy_coef: float = 0.01
    epochs: int = 2
    minibatch: int = 1024
    lr: float = 3e-4
    router_lr: float = 3e-4
    grad_clip: float = 1.0
    eval_every: int = 50_000
    eval_episodes: int = 20
    final_episodes: int = 100
    success_target: float = 0.8

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.arm in ARMS, "arm", f"must be one of {', '.join(ARMS)}, got {self.arm!r}")
        require(
            len(self.tasks) == len(self.task_weights) and len(self.tasks) >= 1,
            "task_weights",
            f"need one weight per task ({len(self.tasks)}), got {len(self.task_weights)}",
        )
        require(
            all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.task_weights)
            and all(isinstance(t, str) for t in self.tasks),
            "tasks",
            f"need gymnasium ids and numeric weights, got {self.tasks!r}, {self.task_weights!r}",
        )
        for name in (
            "frames",
            "groups",
            "group_size",
            "embed_size",
            "hidden_size",
            "num_experts",
            "expert_size",
            "router_size",
            "history",
            "epochs",
            "minibatch",
            "eval_every",
            "eval_episodes",
            "final_episodes",
        ):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "shared_size",
            "max_steps",
            "tau_steps",
            "switch_cost",
            "balance_coef",
            "diversity_coef",
            "step_balance_coef",
            "step_weight",
            "value_coef",
            "kl_coef",
            "entropy_coef",
        ):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("tau_start", "tau_end", "diversity_threshold", "lr", "router_lr", "grad_clip"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("gamma", "gae_lambda", "success_target"):
            v = getattr(self, name)
            require(0.0 < v <= 1.0, name, f"must be in (0, 1], got {v}")
        require(0.0 < self.clip < 1.0, "clip", f"must be in (0, 1), got {self.clip}")
        require(
            self.arm != "step" or self.num_experts >= 2,
            "num_experts",
            f"the step-level router needs >= 2 experts, got {self.num_experts}",
        )

    @property
    def routed(self) -> int:
        """Experts in the bank: 1 for the single policy, else ``num_experts``."""
        return 1 if self.arm == "single" else self.num_experts
