"""Run a learner through a stream and fill the accuracy matrix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moelab.methods.continual.learner import Learner
from moelab.methods.continual.metrics import (
    accuracy_curve,
    average_accuracy,
    backward_transfer,
    forgetting,
    last_accuracy,
    xtail_metrics,
)


@dataclass
class StreamResult:
    """``R`` ``[T, T]`` accuracies in % (NaN: not tested), ``curve`` ``A_t`` [T] in %."""

    R: np.ndarray
    curve: np.ndarray

    def metrics(self) -> dict[str, float]:
        """``avg_acc`` (Ā), ``last_acc``, ``forgetting`` (PILOT) and ``bwt`` (Lopez-Paz);
        with a fully tested table (domain scenario, two tasks or more) also X-TAIL's
        ``transfer``, ``xtail_average`` and ``xtail_last``."""
        out = {
            "avg_acc": average_accuracy(self.curve),
            "last_acc": last_accuracy(self.curve),
            "forgetting": forgetting(self.R),
            "bwt": backward_transfer(self.R),
        }
        if self.R.shape[0] >= 2 and not np.isnan(self.R).any():
            out.update(
                {
                    f"xtail_{k}" if k != "transfer" else k: v
                    for k, v in xtail_metrics(self.R).items()
                }
            )
        return out


def evaluate_task(learner: Learner, t: int, j: int, batch: int = 64) -> tuple[int, int]:
    """``(correct, total)`` on task ``j``'s test texts after task ``t``."""
    stream = learner.stream
    test = list(stream.tasks[j].test)
    cand = stream.candidates(t, j)
    correct = 0
    for s in range(0, len(test), batch):
        idx = test[s : s + batch]
        pred = learner.predict(idx, cand)
        correct += int((pred == learner.labels(idx)).sum())
    return correct, len(test)


def run_stream(
    learner: Learner,
    *,
    start: int = 0,
    stop: int | None = None,
    R: np.ndarray | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> StreamResult:
    """Learn tasks ``start .. stop-1`` (default: the rest of the stream), testing after each
    the tasks :meth:`Stream.tested` names.

    Args:
        R: the matrix of a resumed run (rows before ``start``); a new one by default.
        progress: called with ``(task, A_t)`` after each task.
    """
    stream = learner.stream
    T = stream.num_tasks
    stop = T if stop is None else stop
    if R is None:
        R = np.full((T, T), np.nan)
    for t in range(start, stop):
        learner.learn(t)
        for j in stream.tested(t):
            correct, total = evaluate_task(learner, t, j)
            R[t, j] = 100.0 * correct / total
        if progress is not None:
            sizes = [len(stream.tasks[j].test) for j in range(t + 1)]
            progress(t, float(accuracy_curve(R[: t + 1, : t + 1], sizes)[-1]))
    done = stop
    sizes = [len(stream.tasks[j].test) for j in range(done)]
    curve = accuracy_curve(R[:done, :done], sizes)
    return StreamResult(R[:done, :done].copy(), curve)


def router_hit_rate(learner, batch: int = 64) -> float:
    """CaRE's diagnostic: the fraction of test texts of the learned tasks whose
    lowest-entropy latent head (last adapted block) is their own task's."""
    stream = learner.stream
    hits = total = 0
    for j in range(learner.tasks_learned):
        test = list(stream.tasks[j].test)
        for s in range(0, len(test), batch):
            chosen = learner.routing(test[s : s + batch])
            hits += int((chosen == j).sum())
            total += chosen.numel()
    return hits / total if total else float("nan")


__all__ = ["StreamResult", "evaluate_task", "router_hit_rate", "run_stream"]
