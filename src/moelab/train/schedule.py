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
    """SPARKLING's asymmetric re-warmup of the parameters added at step ``start``
    (arXiv 2602.02472 §4.2.2, Eq. 25–28).

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
