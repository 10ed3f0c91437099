"""The live progress display of ``moelab train`` (rich): step, losses, tokens/s, load, ETA."""

from __future__ import annotations

import math

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    """A rich progress bar with the training fields; a no-op when disabled."""

    def __init__(self, total_steps: int, *, enabled: bool = True, start: int = 0) -> None:
        self.enabled = enabled
        self.fields = {
            "loss": math.nan,
            "aux": math.nan,
            "tok_s": 0.0,
            "imbalance": math.nan,
            "val": math.nan,
        }
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn(
                "loss {task.fields[loss]:.3f}  aux {task.fields[aux]:.4f}  "
                "val bpb {task.fields[val]:.3f}  {task.fields[tok_s]:,.0f} tok/s  "
                "max/mean load {task.fields[imbalance]:.2f}"
            ),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start, **self.fields
        )

    def __enter__(self) -> TrainProgress:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def update(self, step: int, **fields: float) -> None:
        self.fields.update(fields)
        if self.enabled:
            self.progress.update(self.task, completed=step, **self.fields)

    def set_total(self, total_steps: int) -> None:
        if self.enabled:
            self.progress.update(self.task, total=total_steps)

    def set_val(self, bpb: float) -> None:
        self.update(self.progress.tasks[0].completed if self.enabled else 0, val=bpb)
