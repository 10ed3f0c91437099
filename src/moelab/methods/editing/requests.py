"""Edit requests: a prompt and the new target it should be completed with, read from a JSONL
or CSV file and tokenised for teacher forcing.

A file row has the fields ``prompt`` and ``target`` (strings; extra fields are kept in
``meta``, e.g. ``subject``). The target is appended to the prompt as written, so a word
after a space starts with one: ``{"prompt": "The capital city of France is", "target":
" Rome"}``.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


@dataclass(frozen=True)
class EditRequest:
    """One edit: ``prompt`` should be continued by ``target``."""

    prompt: str
    target: str
    meta: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TokenizedEdit:
    """An edit ready for teacher forcing.

    Attributes:
        input_ids: ``[S]`` int64, prompt + target without its last token.
        positions: ``[P]`` int64, the positions whose next token is a target token
            (``len(prompt)-1 …  S-1``).
        targets: ``[P]`` int64, the target tokens.
    """

    input_ids: Tensor
    positions: Tensor
    targets: Tensor


def tokenize_edit(
    request: EditRequest, tokenizer, max_len: int, where: str = "edit"
) -> TokenizedEdit:
    """Tokenise ``request`` (``tokenizer.encode(str) -> list[int]``).

    Raises:
        InvalidValueError: an empty prompt or target, one that tokenises to nothing, or a
            sequence longer than ``max_len`` (named by ``where``).
    """
    if not request.prompt.strip():
        raise InvalidValueError(f"{where}: empty prompt")
    if not request.target.strip():
        raise InvalidValueError(f"{where}: empty target for prompt {request.prompt!r}")
    prompt = list(tokenizer.encode(request.prompt))
    target = list(tokenizer.encode(request.target))
    if not prompt:
        raise InvalidValueError(f"{where}: prompt {request.prompt!r} tokenises to nothing")
    if not target:
        raise InvalidValueError(f"{where}: target {request.target!r} tokenises to nothing")
    ids = prompt + target[:-1]
    if len(ids) > max_len:
        raise InvalidValueError(f"{where}: {len(ids)} tokens exceed the model's {max_len}")
    start = len(prompt) - 1
    return TokenizedEdit(
        torch.tensor(ids, dtype=torch.long),
        torch.arange(start, start + len(target), dtype=torch.long),
        torch.tensor(target, dtype=torch.long),
    )


def _request(row: object, where: str) -> EditRequest:
    if not isinstance(row, dict):
        raise InvalidValueError(f"{where}: expected an object with 'prompt' and 'target'")
    missing = [k for k in ("prompt", "target") if k not in row or row[k] is None]
    if missing:
        raise InvalidValueError(f"{where}: missing field {missing[0]!r}")
    bad = [k for k in ("prompt", "target") if not isinstance(row[k], str)]
    if bad:
        raise InvalidValueError(f"{where}: field {bad[0]!r} must be a string")
    meta = {k: str(v) for k, v in row.items() if k not in ("prompt", "target")}
    request = EditRequest(row["prompt"], row["target"], meta)
    if not request.prompt.strip():
        raise InvalidValueError(f"{where}: empty prompt")
    if not request.target.strip():
        raise InvalidValueError(f"{where}: empty target")
    return request


def read_edits(path: str | Path) -> list[EditRequest]:
    """The edit requests of a ``.jsonl`` (one object a line) or ``.csv`` (a header row) file.

    Raises:
        InvalidValueError: no such file, another extension, a line that is not JSON, a row
            missing ``prompt`` or ``target``, an empty one, or no edits at all (names the
            file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidValueError(f"{path}: no such edit file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise InvalidValueError(f"{path}: edit files are .jsonl or .csv, got {suffix or 'none'!r}")
    text = path.read_text(encoding="utf-8")
    out = []
    if suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            out.append(_request(row, f"{path}:{n}"))
    else:
        for n, row in enumerate(csv.DictReader(text.splitlines()), 2):
            out.append(_request(row, f"{path}:{n}"))
    if not out:
        raise InvalidValueError(f"{path}: no edits")
    return out
