"""``metrics.jsonl``: one JSON object per line (train logs and validations)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moelab.utils.atomic import atomic_write_text


class MetricsLog:
    """Append-only JSON-lines log; on resume, lines after the resumed step are dropped so the
    curve continues exactly where the checkpoint left it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
