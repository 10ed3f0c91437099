"""Fingerprints of a run's data: the corpus documents and the tokenizer files.

``run.json`` stores both when a run starts; ``--resume`` recomputes them and refuses to
continue on a different corpus or tokenizer (a corpus edited between an interrupt and the
resume would otherwise silently change the run).

The corpus fingerprint is sha256 over, per document in load order, its domain, name and
UTF-8 text, each length-prefixed (so no two different corpora hash alike by shifting bytes
between fields). The tokenizer fingerprint is the sha256 of each tokenizer file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moelab.data.corpora import Document
from moelab.data.tokenizer import BPE_FILE, META_FILE

TOKENIZER_FILES = (META_FILE, BPE_FILE)


def corpus_fingerprint(docs: Sequence[Document]) -> dict[str, Any]:
    """``{"sha256": hex, "documents": n, "bytes": total UTF-8 bytes}`` of ``docs``."""
    h = hashlib.sha256()
    total = 0
    for d in docs:
        for part in (d.domain, d.name, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        total += d.n_bytes
    return {"sha256": h.hexdigest(), "documents": len(docs), "bytes": total}


def tokenizer_files(folder: str | Path) -> list[str]:
    """Names of the tokenizer files present in ``folder``."""
    return [n for n in TOKENIZER_FILES if (Path(folder) / n).is_file()]


def tokenizer_fingerprint(folder: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` of the tokenizer files in ``folder``."""
    out = {}
    for name in tokenizer_files(folder):
        out[name] = hashlib.sha256((Path(folder) / name).read_bytes()).hexdigest()
    return out


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """One phrase saying how corpus fingerprint ``old`` differs from ``new``."""
    return (
        f"{old.get('documents')} documents / {old.get('bytes')} bytes (sha256 "
        f"{str(old.get('sha256'))[:12]}) then, {new['documents']} / {new['bytes']} "
        f"(sha256 {new['sha256'][:12]}) now"
    )
