"""A held-out next-line multiple choice for byte- or BPE-level LMs: a context (the
``context_chars`` characters before a line of 20–80 characters) and four candidate next lines,
the true one and three from other documents of the same domain, scored by the model's
domain-conditional PMI ``log p(c | context) − log p(c | prefix)`` (Holtzman et al. 2021,
arXiv 2104.08315); accuracy per domain and overall, chance 25 %.

[Our choice: the mean log-likelihood per byte puts a small byte-level model at chance, PMI
does not: a line's own likelihood swamps the context's evidence.] A domain whose documents are
one long text (a play, a book) is cut into 4 KB pieces that count as documents. Used by
``prune.py`` (the pruned models' downstream score) and ``sparkling.py --downstream``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelab.data import Document


@dataclass(frozen=True)
class Item:
    """One multiple-choice question: context ids and four candidate id lists (0 = true)."""

    context: list[int]
    candidates: list[list[int]]
    cand_bytes: list[int]
    domain: str


def pseudo_documents(docs: list[Document], chunk: int = 4096) -> dict[str, list[str]]:
    """Per domain, the documents' texts; a one-document domain is cut into ``chunk``-char
    pieces (at line starts)."""
    by: dict[str, list[str]] = {}
    for d in docs:
        by.setdefault(d.domain, []).append(d.text)
    for dom, texts in by.items():
        if len(texts) == 1:
            text, pieces, start = texts[0], [], 0
            while start < len(text):
                end = text.find("\n", start + chunk)
                end = len(text) if end < 0 else end + 1
                pieces.append(text[start:end])
                start = end
            by[dom] = pieces
    return by


def mc_items(docs, tokenizer, per_domain: int, context_chars: int, seed: int = 0) -> list[Item]:
    """``per_domain`` next-line questions per domain (lines of 20–80 characters)."""
    rng = random.Random(f"moelab-prune-mc:{seed}")
    items = []
    for dom, texts in sorted(pseudo_documents(docs).items()):
        lines = []  # (doc index, start offset, line text with newline)
        for j, text in enumerate(texts):
            pos = 0
            for line in text.splitlines(keepends=True):
                if 20 <= len(line.strip()) <= 80 and line.endswith("\n"):
                    lines.append((j, pos, line))
                pos += len(line)
        answerable = [x for x in lines if x[1] >= context_chars]
        rng.shuffle(answerable)
        for j, pos, line in answerable[:per_domain]:
            others = [x[2] for x in lines if x[0] != j]
            if len(others) < 3:
                continue
            context = texts[j][pos - context_chars : pos]
            cands = [line, *rng.sample(others, 3)]
            items.append(
                Item(
                    context=tokenizer.encode(context),
                    candidates=[tokenizer.encode(c) for c in cands],
                    cand_bytes=[len(c.encode("utf-8")) for c in cands],
                    domain=dom,
                )
            )
    return items


@torch.inference_mode()
def mc_accuracy(model, items: list[Item], prefix: list[int], batch_items: int = 6) -> dict:
    """Accuracy per domain and overall. Each candidate is scored by its domain-conditional
    PMI ``log p(c | context) − log p(c | prefix)`` (Holtzman et al. 2021, arXiv 2104.08315;
    ``prefix`` = a newline), which removes how likely the line is on its own; the highest
    wins, ties count as wrong."""
    device = next(model.parameters()).device
    correct: dict[str, list[int]] = {}
    for s in range(0, len(items), batch_items):
        chunk = items[s : s + batch_items]
        seqs, spans = [], []
        for it in chunk:
            for head in (it.context, prefix):
                for c in it.candidates:
                    spans.append((len(head), c))
                    seqs.append(head + c)
        S = max(len(q) for q in seqs)
        ids = torch.zeros(len(seqs), S, dtype=torch.int64)
        for r, q in enumerate(seqs):
            ids[r, : len(q)] = torch.tensor(q)
        logp = F.log_softmax(model(ids.to(device)).logits.float(), dim=-1).cpu()
        ll = [
            float(logp[r, torch.arange(n0 - 1, n0 - 1 + len(c)), torch.tensor(c)].sum())
            for r, (n0, c) in enumerate(spans)
        ]
        for i, it in enumerate(chunk):
            cond, unc = ll[8 * i : 8 * i + 4], ll[8 * i + 4 : 8 * i + 8]
            pmi = [a - b for a, b in zip(cond, unc, strict=True)]
            ok = int(max(range(4), key=lambda j: pmi[j]) == 0 and pmi.count(pmi[0]) == 1)
            correct.setdefault(it.domain, []).append(ok)
            correct.setdefault("all", []).append(ok)
    return {k: sum(v) / len(v) for k, v in correct.items()}
