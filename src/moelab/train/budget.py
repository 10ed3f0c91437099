"""A step count fitted to a wall-clock budget, so that the cosine ends when the time does.

``moelab train --time-budget S --fit-to-budget`` times the first optimizer steps, then fixes
the run's total steps (at most ``--steps``) to the number that finishes within ``S`` seconds,
validations included, and keeps that count in ``run.json`` so that ``--resume`` follows the
same schedule. Without the fit a time budget only stops the run, and a slow machine stops in
the middle of its cosine with the learning rate still high.

The fit is taken at the end of the linear warmup, the first step whose learning rate depends
on the total, from the median of the timed steps (the first :data:`SKIP_STEPS` are left out:
allocator and cache warm-up). When the warmup is shorter than the steps that must be timed,
the steps in between follow the cosine of ``--steps`` [our choice]. A safety :data:`MARGIN`
of the budget is left for step-time drift on a shared machine; the budget still stops the run
if the machine slows down more than that.

The fit is taken again after every validation, from the steps timed since the last fit and
that validation's cost [our choice]. On a shared 2-core machine the step time drifts by ±15 %
over minutes and the first hundred steps run ~10 % slower than the rest, so a single fit from
the warmup left up to 15 % of the budget unused. A refit keeps the learning rate continuous:
the cosine's progress ``p`` (0 after the warmup, 1 at the end) carries on from its value at
the refit, ``p(s) = p_f + (1 − p_f)·(s − a_f)/(T_f − a_f)`` for the latest fit ``f`` taken
before step ``s`` at step ``a_f`` with total ``T_f`` (:func:`progress_at`). Every fit is
recorded, so ``--resume`` replays them and reproduces the uninterrupted run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

SKIP_STEPS = 10
"""Steps not timed at the start of a run or a resume (warm-up of caches and allocator: in a
fresh ``make run`` process the first ~20 steps took 0.9-1.05 s against 0.6-0.7 s later)."""
MIN_TIMED_STEPS = 5
"""Timed steps the fit needs at least."""
MARGIN = 0.03
"""Fraction of the budget left free for step-time drift."""


@dataclass(frozen=True)
class BudgetFit:
    """The fitted schedule, as recorded in ``run.json`` under ``"budget_fit"``.

    Attributes:
        at_step: the optimizer step (0-based) before which the fit was taken.
        requested_steps: ``--steps`` as given (the fit's upper bound).
        steps: the fitted total of optimizer steps.
        step_s: median seconds of one timed optimizer step.
        eval_s: seconds of one validation (the last one before the fit; 0 if none ran).
        checkpoint_s: seconds of one checkpoint (the last one before the fit; 0 if none).
        progress: the cosine's progress at ``at_step``, in [0, 1] (see :func:`progress_at`).
    """

    at_step: int
    requested_steps: int
    steps: int
    step_s: float
    eval_s: float
    checkpoint_s: float
    progress: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def progress_at(
    step: int, *, warmup_steps: int, requested_steps: int, fits: list[BudgetFit]
) -> float:
    """The cosine's progress in [0, 1] at optimizer step ``step >= warmup_steps``: that of
    ``requested_steps`` before the first fit, then carried on by the latest fit taken at or
    before ``step`` (the module docstring has the formula)."""
    taken = [f for f in fits if f.at_step <= step]
    if not taken:
        return min((step - warmup_steps) / max(requested_steps - warmup_steps, 1), 1.0)
    f = taken[-1]
    return min(
        f.progress + (1 - f.progress) * (step - f.at_step) / max(f.steps - f.at_step, 1), 1.0
    )


def recorded_fits(run_info: dict, warmup_steps: int) -> list[BudgetFit]:
    """The fits a run recorded in ``run.json``, in the order taken. A run from before refits
    recorded one ``"budget_fit"`` whose cosine restarted at the fit as that of the fitted total;
    its progress at the fit, ``(a − w)/(T − w)``, reproduces that schedule."""
    if "budget_fits" in run_info:
        return [BudgetFit(**f) for f in run_info["budget_fits"]]
    if "budget_fit" in run_info:
        f = BudgetFit(**run_info["budget_fit"])
        span = max(f.steps - warmup_steps, 1)
        return [replace(f, progress=min(max(f.at_step - warmup_steps, 0) / span, 1.0))]
    return []


def fit_step(warmup_steps: int) -> int:
    """The step before which the fit is taken: the end of the warmup, but late enough for
    :data:`MIN_TIMED_STEPS` timed steps after the :data:`SKIP_STEPS` untimed ones."""
    return max(warmup_steps, SKIP_STEPS + MIN_TIMED_STEPS)


def _events(start: int, end: int, every: int) -> int:
    """Multiples of ``every`` in ``(start, end]`` (0 when ``every`` is 0: never)."""
    return end // every - start // every if every else 0


def predicted_seconds(
    steps: int,
    *,
    step: int,
    elapsed_s: float,
    step_s: float,
    eval_every: int,
    eval_s: float,
    checkpoint_every: int,
    checkpoint_s: float,
) -> float:
    """Seconds of training when a run now at ``step`` after ``elapsed_s`` seconds stops at
    ``steps``: the steps left, their validations (every ``eval_every`` steps and one at the
    end) and their checkpoints (every ``checkpoint_every`` steps, not the final one, which is
    written after the budget is checked), as the loop runs them."""
    evals = _events(step, steps, eval_every) + (1 if steps % eval_every else 0)
    checkpoints = _events(step, steps - 1, checkpoint_every)
    return elapsed_s + (steps - step) * step_s + evals * eval_s + checkpoints * checkpoint_s


def fit_steps(
    *,
    step: int,
    elapsed_s: float,
    budget_s: float,
    max_steps: int,
    step_times: list[float],
    eval_every: int,
    eval_s: float,
    checkpoint_every: int,
    checkpoint_s: float,
    progress: float = 0.0,
) -> BudgetFit:
    """The largest total in ``[step + 1, max_steps]`` whose :func:`predicted_seconds` stays
    within ``(1 − MARGIN) · budget_s`` (``step + 1`` when none does: the budget then stops
    the run).

    Args:
        step: the optimizer steps done (the fit applies from this step on).
        elapsed_s: seconds of training so far (validations and checkpoints included).
        budget_s: the time budget, seconds.
        max_steps: the requested steps, the upper bound.
        step_times: seconds of the timed steps (at least :data:`MIN_TIMED_STEPS`).
        eval_every, checkpoint_every: the run's intervals, steps (checkpoint 0 = never).
        eval_s, checkpoint_s: seconds of one validation and one checkpoint.
        progress: the cosine's progress at ``step``, recorded with the fit.

    Raises:
        ValueError: fewer than :data:`MIN_TIMED_STEPS` step times, or a step time that is
            not a finite number > 0.
    """
    if len(step_times) < MIN_TIMED_STEPS:
        raise ValueError(f"need >= {MIN_TIMED_STEPS} step times, got {len(step_times)}")
    if not all(math.isfinite(t) and t > 0 for t in step_times):
        raise ValueError(f"step times must be finite and > 0, got {step_times}")
    step_s = statistics.median(step_times)
    limit = (1 - MARGIN) * budget_s

    def fits(n: int) -> bool:
        return (
            predicted_seconds(
                n,
                step=step,
                elapsed_s=elapsed_s,
                step_s=step_s,
                eval_every=eval_every,
                eval_s=eval_s,
                checkpoint_every=checkpoint_every,
                checkpoint_s=checkpoint_s,
            )
            <= limit
        )

    lo, hi = step + 1, max_steps  # predicted_seconds grows with the total: bisect
    if not fits(lo):
        hi = lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return BudgetFit(
        at_step=step,
        requested_steps=max_steps,
        steps=lo,
        step_s=step_s,
        eval_s=eval_s,
        checkpoint_s=checkpoint_s,
        progress=progress,
    )
