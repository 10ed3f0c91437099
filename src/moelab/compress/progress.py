"""A rich progress bar with tokens/s for calibration passes (a no-op when disabled)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class TokenProgress:
    """``with TokenProgress("calibrating", total_tokens) as bar: route(..., on_batch=bar)``.

    Shows tokens done / total and tokens per second; :meth:`start_pass` relabels the bar for
    another pass (layer-wise methods run several). Writes to ``console`` (default stderr).
    """

    def __init__(
        self, label: str, total_tokens: int | None, *, enabled: bool = True, console=None
    ) -> None:
        self.enabled = enabled
        self.tokens = 0
        self.t0 = time.perf_counter()
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            TextColumn(
                "{task.completed:,.0f}/{task.total:,.0f} tok  {task.fields[tok_s]:,.0f} tok/s"
            ),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
        )
        self.task = self.progress.add_task(label, total=total_tokens, tok_s=0.0)

    def __enter__(self) -> TokenProgress:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def start_pass(self, label: str, total_tokens: int | None) -> None:
        """Reset the bar for a new pass of ``total_tokens`` tokens."""
        self.tokens, self.t0 = 0, time.perf_counter()
        if self.enabled:
            self.progress.reset(self.task, total=total_tokens, description=label, tok_s=0.0)

    def __call__(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.progress.update(self.task, advance=n_tokens, tok_s=rate)
