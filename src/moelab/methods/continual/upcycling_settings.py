"""Knobs of the upcycling arms (``ContinualConfig.upcycling``): sequential fine-tuning with
replay, full upcycling and CKA-guided selective upcycling (``wave3-continual.md`` §5.2,
"TRACE-lite"). Labels: [P] the poster's abstract (ICML 2026 poster 64571), [S] the research
spec's value, [I] this project's choice (no code or full text is public)."""

from __future__ import annotations

from dataclasses import dataclass

from moelab.errors import require
from moelab.utils.fields import check_fields

UPCYCLING_ARMS = ("seqft-replay", "full-upcycling", "selective-upcycling")
"""The arms' method names (:mod:`moelab.methods.continual.upcycling`)."""


@dataclass(frozen=True)
class UpcyclingSettings:
    """Training of the upcycling arms, per task.

    Attributes:
        steps: inner (weight) steps per task, every arm (40 [S: "cut to 40 steps per task"]).
        search_fraction: the selective arm's share of ``steps`` spent searching with the
            Gumbel mask; the rest fine-tunes the discretised architecture (2/3 [I]).
        outer_every: one mask (α) step every this many inner steps (5 [S]).
        replay_per_task: items kept per learned task (20 [S]).
        replay_batch: replay items mixed into every step after the first task (16 [I]).
        lr: Adam learning rate of the FFNs, experts and routers (5e-4 [I]).
        head_lr: Adam learning rate of the per-task linear heads (1e-2 [I]).
        mask_lr: Adam learning rate of the mask logits α (0.05 [I], DARTS' order of magnitude
            for α with Adam is 3e-4 over thousands of steps; here there are a dozen).
        cka_weight: λ_cka of the CKA replay term Σ_l (1 − CKA) (1.0 [I]).
        size_weight: λ_p of the growth penalty Σ_l P(grow_l)·|θ_new,l|/|θ_base| (0.5 [I]:
            one MiniLM expert is 5 % of the encoder, so growing a layer costs about 0.03
            nats; at 2.0 no layer ever grew on TRACE-lite, see the method's page).
        tau_start, tau_end: Gumbel temperature annealed geometrically (1 → 0.1 [S]).
        holdout: fraction of each task's training texts held out for the outer step (0.2 [I]).
        probe_size: test texts (all tasks, drawn once per seed) whose per-layer features give
            the CKA curves before/after each task (64 [I]).
    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    steps: int = 40
    search_fraction: float = 2 / 3
    outer_every: int = 5
    replay_per_task: int = 20
    replay_batch: int = 16
    lr: float = 5e-4
    head_lr: float = 1e-2
    mask_lr: float = 0.05
    cka_weight: float = 1.0
    size_weight: float = 0.5
    tau_start: float = 1.0
    tau_end: float = 0.1
    holdout: float = 0.2
    probe_size: int = 64

    def __post_init__(self) -> None:
        check_fields(self, prefix="upcycling.")
        for name in ("steps", "outer_every", "replay_per_task"):
            v = getattr(self, name)
            require(v >= 1, f"upcycling.{name}", f"must be >= 1, got {v}")
        for name in ("replay_batch", "probe_size"):  # CKA needs two rows
            v = getattr(self, name)
            require(v >= 2, f"upcycling.{name}", f"must be >= 2, got {v}")
        for name in ("lr", "head_lr", "mask_lr", "tau_start", "tau_end"):
            v = getattr(self, name)
            require(v > 0, f"upcycling.{name}", f"must be > 0, got {v}")
        for name in ("cka_weight", "size_weight"):
            v = getattr(self, name)
            require(v >= 0, f"upcycling.{name}", f"must be >= 0, got {v}")
        for name in ("search_fraction", "holdout"):
            v = getattr(self, name)
            require(0 < v < 1, f"upcycling.{name}", f"must be in (0, 1), got {v}")
