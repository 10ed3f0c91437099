"""Learning-rate schedule: linear warmup then cosine decay to ``min_lr_ratio · lr``."""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    progress: float | None = None,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    ``lr · (step+1)/warmup`` during warmup; then
    ``lr · (r + (1−r)·½(1 + cos(π·progress)))`` with progress from 0 to 1 over the remaining
    steps and ``r = min_lr_ratio``. A given ``progress`` (a schedule refitted to a time
    budget: :func:`moelab.train.budget.progress_at`) replaces the one from ``total_steps``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if progress is None:
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scheduled_lr(cfg, step: int, progress: float | None = None) -> float:
    """:func:`lr_at` with a :class:`~moelab.train.config.TrainConfig`'s schedule fields."""
    return lr_at(
        step,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
        min_lr_ratio=cfg.min_lr_ratio,
        progress=progress,
    )


def rewarm_boost(step: int, *, start: int, rewarm_steps: int, ratio: float) -> float:
    """The factor on the base schedule's rate of the parameters added at step ``start`` under
    the short re-warmup (``rewarm_tail="base"``): with ``s = step − start`` and ``τ_w =
    rewarm_steps``, ``1 + (ρ − 1)·s/τ_w`` while ``s < τ_w`` (rising from 1 to ρ), ``1 + (ρ −
    1)·(2τ_w − s)/τ_w`` while ``τ_w ≤ s < 2τ_w`` (falling back to 1), then 1: after ``2τ_w``
    steps the new entries follow the old entries' schedule exactly [I: SPARKLING's re-warmup
    is "short" (secondary summaries of arXiv 2602.02472); the fall's length is our choice].
    ``τ_w = 0`` or ``ρ = 1`` gives 1 throughout (no boost). Returns a float >= 0."""
    s = step - start
    if rewarm_steps <= 0 or s < 0 or s >= 2 * rewarm_steps:
        return 1.0
    rise = s / rewarm_steps if s < rewarm_steps else (2 * rewarm_steps - s) / rewarm_steps
    return 1.0 + (ratio - 1.0) * rise


def rewarm_lr_at(
    step: int,
    *,
    start: int,
    rewarm_steps: int,
    total_steps: int,
    lr_start: float,
    ratio: float,
    min_lr: float,
) -> float:
    """SPARKLING's asymmetric re-warmup of the parameters added at step ``start`` with their
    own cosine after it (``rewarm_tail="own"``; this project's reading of arXiv 2602.02472
    §4.2.2, Eq. 25–28). The new entries then run above the old ones' rate for the whole rest
    of the run (about 1.5× on average, up to 1.8×, for an expansion at mid-run).

    ``η_new(t) = f(t − t_e; τ_w, T − t_e, η_e, ρ·η_e, η_min)`` with the paper's
    warmup-then-cosine ``f``: with ``s = step − start``,

    - ``s < τ_w``: ``η_e + (ρ·η_e − η_e) · s/τ_w`` (starts exactly at ``η_e``, linear);
    - ``s ≥ τ_w``: ``η_min + (ρ·η_e − η_min) · ½(1 + cos(π·p))``,
      ``p = min((s − τ_w)/(T − t_e − τ_w), 1)``.

    Args:
        step: optimizer step (0-based, ``>= start``).
        start: t_e, the step the new parameters first take.
        rewarm_steps: τ_w >= 0, steps of the linear rise.
        total_steps: T, the run's total steps (the cosine ends there, as the base one does).
        lr_start: η_e, the base schedule's rate at ``start``.
        ratio: ρ, the peak over ``η_e`` (paper default 1.3).
        min_lr: η_min, the base schedule's final rate.
    Returns:
        the learning rate (same units as ``lr_start``). The discretisation — ``s/τ_w``
        rather than the base warmup's ``(s+1)/τ_w``, so step ``start`` runs at exactly
        ``η_e`` — is this project's reading of "starts exactly from the current learning
        rate" [I].
    """
    s = step - start
    peak = ratio * lr_start
    if s < rewarm_steps:
        return lr_start + (peak - lr_start) * s / rewarm_steps
    span = max(total_steps - start - rewarm_steps, 1)
    progress = min((s - rewarm_steps) / span, 1.0)
    return min_lr + (peak - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
