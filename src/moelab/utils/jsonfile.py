"""Reading JSON files with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, error: type[Exception] = ValueError) -> Any:
    """Parse ``path``; a missing, unreadable or malformed file raises ``error`` naming it."""
    if not path.is_file():
        raise error(f"{path}: missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
