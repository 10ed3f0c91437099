"""Learning-rate schedule: linear warmup then cosine decay to ``min_lr_ratio · lr``."""

from __future__ import annotations

import math


def lr_at(
    step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    ``lr · (step+1)/warmup`` during warmup; then
    ``lr · (r + (1−r)·½(1 + cos(π·progress)))`` with progress from 0 to 1 over the remaining
    steps and ``r = min_lr_ratio``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
