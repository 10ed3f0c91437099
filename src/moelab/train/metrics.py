"""``metrics.jsonl``: one JSON object per line (train logs and validations).

A full disk or a kill can leave the last line torn (no newline, invalid JSON): it is dropped
when the log is next truncated on resume. Any other invalid line raises :class:`MetricsError`
naming the file and line. The log is never written through a symlink.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from moelab.errors import InvalidValueError
from moelab.utils.atomic import atomic_write_text, disk_full_error, is_disk_full
from moelab.utils.paths import refuse_symlink


class MetricsError(InvalidValueError):
    """``metrics.jsonl`` has an invalid line (other than a torn last one)."""


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


class MetricsLog:
    """Append-only JSON-lines log; on resume, lines after the resumed step are dropped so the
    curve continues exactly where the checkpoint left it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def read(self) -> list[dict[str, Any]]:
        """Every record, a torn last line left out.

        Raises:
            MetricsError: a line other than the last is not a JSON object with an int ``step``.
        """
        if not self.path.exists():
            return []
        refuse_symlink(self.path, what="metrics log")
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise MetricsError(f"{self.path}: cannot read ({e.strerror})") from e
        lines = text.split("\n")
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        records = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and isinstance(rec.get("step", 0), int)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                if i == last:  # a torn tail (full disk, kill mid-write): drop it
                    break
                raise MetricsError(
                    f"{self.path}: line {i + 1} is not a metrics record; remove or fix that line"
                )
            records.append(rec)
        return records

    def truncate_after(self, step: int) -> None:
        """Keep the records with ``step <= step`` (and drop a torn last line)."""
        if not self.path.exists():
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (non-finite floats become ``null``).

        Raises:
            DiskFullError: the disk is full (the torn line is dropped on resume).
            UnsafePathError: the log is a symlink.
        """
        line = json.dumps({k: _clean(v) for k, v in record.items()}, allow_nan=False) + "\n"
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        refuse_symlink(self.path, what="metrics log")
        try:
            fd = os.open(self.path, flags, 0o666)
            try:
                data = line.encode("utf-8")
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
        except OSError as e:
            if is_disk_full(e):
                raise disk_full_error(self.path, e, needed=len(line)) from e
            raise
