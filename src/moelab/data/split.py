"""Deterministic train/validation split by whole document, stratified per domain."""

from __future__ import annotations

import random
from dataclasses import replace

from moelab.data.corpora import Document
from moelab.data.errors import CorpusError
from moelab.errors import InvalidValueError


def split_documents(
    docs: list[Document], *, val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val), deterministically for a given ``seed``.

    Per domain with ``n >= 2`` documents, ``clamp(round(n * val_fraction), 1, n - 1)`` whole
    documents go to validation, chosen by ``random.Random("moelab-split:{seed}:{domain}")``;
    so every such domain has at least one document on each side.

    A domain with a single document (e.g. a one-file user corpus) is split by text position
    instead, independent of ``seed``: the last ``max(1, round(len(text) * val_fraction))``
    characters go to validation, with the cut moved back to the start of a line when one
    lies within that many characters before it. The halves are named ``"{name}#train"`` and
    ``"{name}#val"``.

    Both lists keep the input order of the documents.

    Args:
        docs: the corpus (non-empty).
        val_fraction: fraction of each domain's documents for validation, in ``(0, 1)``.
        seed: split seed.

    Returns:
        ``(train, val)``: disjoint, together covering every document (or both halves).

    Raises:
        CorpusError: ``docs`` is empty, or a single-document domain has fewer than 2 characters.
        ValueError: ``val_fraction`` not in ``(0, 1)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise InvalidValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if not docs:
        raise CorpusError("cannot split an empty corpus")
    by_domain: dict[str, list[int]] = {}
    for i, doc in enumerate(docs):
        by_domain.setdefault(doc.domain, []).append(i)

    val_idx: set[int] = set()
    halves: dict[int, tuple[Document, Document]] = {}
    for domain, indices in by_domain.items():
        n = len(indices)
        if n == 1:
            halves[indices[0]] = split_text(docs[indices[0]], val_fraction)
            continue
        n_val = min(max(round(n * val_fraction), 1), n - 1)
        order = list(indices)
        random.Random(f"moelab-split:{seed}:{domain}").shuffle(order)
        val_idx.update(order[:n_val])

    train: list[Document] = []
    val: list[Document] = []
    for i, doc in enumerate(docs):
        if i in halves:
            train.append(halves[i][0])
            val.append(halves[i][1])
        elif i in val_idx:
            val.append(doc)
        else:
            train.append(doc)
    return train, val


def split_text(doc: Document, val_fraction: float) -> tuple[Document, Document]:
    """Split one document by position into ``(train_head, val_tail)``; see ``split_documents``.

    Raises:
        CorpusError: the text has fewer than 2 characters.
    """
    text = doc.text
    if len(text) < 2:
        raise CorpusError(
            f"document {doc.name!r} has {len(text)} character(s); need at least 2 to split"
        )
    n_val = min(max(round(len(text) * val_fraction), 1), len(text) - 1)
    cut = len(text) - n_val
    line_start = text.rfind("\n", max(cut - n_val, 0), cut) + 1
    if line_start > 0:  # rfind found a newline within n_val characters before the cut
        cut = line_start
    return (
        replace(doc, name=f"{doc.name}#train", text=text[:cut]),
        replace(doc, name=f"{doc.name}#val", text=text[cut:]),
    )
