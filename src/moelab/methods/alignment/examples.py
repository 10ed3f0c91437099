"""Training and evaluation sequences: ChatML prompts, response-only labels, padded batches.

SmolLM2-Instruct's chat format is ChatML (``<|im_start|>role\\n…<|im_end|>``); prompts are
rendered without a system turn to keep them short [I]. A chat example is the prompt, then the
response and ``<|im_end|>``; only the response tokens are predicted (response-only SFT). A
corpus window has no prompt: every token after the first is predicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.data.tokenizer import Tokenizer


def chat_prompt(text: str) -> str:
    """``text`` as a ChatML user turn followed by the assistant's turn header."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Example:
    """One sequence: ``ids`` (prompt then response), ``n_prompt`` prompt tokens (the first
    ``n_prompt`` ids are not predicted; at least 1), ``safe`` (the safety stream)."""

    ids: tuple[int, ...]
    n_prompt: int
    safe: bool


def chat_example(
    tok: Tokenizer, prompt: str, response: str, *, safe: bool, max_len: int, end: bool = True
) -> Example:
    """The ChatML example of ``prompt`` answered by ``response`` (``<|im_end|>`` appended
    with ``end``; without it the response is an open prefix, as the refusal margin scores
    it), the prompt cut from the left so the whole fits ``max_len`` tokens."""
    p = tok.encode(chat_prompt(prompt))
    r = tok.encode(response + ("<|im_end|>" if end else ""))[: max_len - 1]
    p = p[-(max_len - len(r)) :]
    return Example(tuple(p + r), len(p), safe)


def window_example(ids: Sequence[int]) -> Example:
    """A corpus window: every token after the first is predicted (general stream)."""
    return Example(tuple(ids), 1, False)


@dataclass
class Batch:
    """Right-padded examples.

    Attributes:
        ids: ``[B, S]`` int64 (padding 0). mask: ``[B, S]`` bool, True = real token.
        positions: ``[N, 2]`` int64 (row, column) of every predicting position (its label is
            the next token). targets: ``[N]`` int64 those labels.
        safe_tokens: ``[B·S]`` bool, the real tokens of safety-stream rows (flattened).
        rows: ``[N]`` int64, each predicting position's row.
    """

    ids: Tensor
    mask: Tensor
    positions: Tensor
    targets: Tensor
    safe_tokens: Tensor
    rows: Tensor


def collate(examples: Sequence[Example]) -> Batch:
    """Pad ``examples`` into one :class:`Batch`."""
    B, S = len(examples), max(len(e.ids) for e in examples)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    pos, tgt = [], []
    safe = torch.zeros(B, S, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids[b, :n] = torch.tensor(e.ids)
        mask[b, :n] = True
        safe[b, :n] = e.safe
        for j in range(e.n_prompt - 1, n - 1):
            pos.append((b, j))
            tgt.append(e.ids[j + 1])
    positions = torch.tensor(pos, dtype=torch.long).reshape(-1, 2)
    return Batch(
        ids, mask, positions, torch.tensor(tgt, dtype=torch.long), safe.reshape(-1), positions[:, 0]
    )
