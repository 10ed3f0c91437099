"""Teacher-forced predictions over a fixed set of prompts, with the frozen prefix cached.

The states entering the edited layer's block do not depend on any edit, so a
:class:`PromptSet` computes them once (the "pre-edit pass"); every later prediction — before
the edits, after them, after restoring — runs only the top blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.methods.editing.editor import pad_batch


@dataclass
class PromptSet:
    """Padded batches of prompts: ``(ids [B, S], mask [B, S], hidden [B, S, D], positions)``
    with ``positions`` one 1-D int64 tensor per row (where its predictions are read)."""

    batches: list[tuple[Tensor, Tensor, Tensor, list[Tensor]]]
    start_block: int

    def __len__(self) -> int:
        return sum(len(b[3]) for b in self.batches)


def prompt_set(
    model: nn.Module,
    seqs: Sequence[Tensor],
    positions: Sequence[Tensor],
    start_block: int,
    batch_size: int = 32,
) -> PromptSet:
    """Cache the states entering ``start_block`` for ``seqs`` (1-D int64 token sequences),
    read at ``positions`` (one 1-D int64 tensor per sequence)."""
    batches = []
    for i in range(0, len(seqs), batch_size):
        ids, mask = pad_batch(seqs[i : i + batch_size])
        hidden = model.hidden_at(ids, mask, block=start_block)
        batches.append((ids, mask, hidden, list(positions[i : i + batch_size])))
    return PromptSet(batches, start_block)


def predict(model: nn.Module, prompts: PromptSet) -> list[Tensor]:
    """The model's argmax token ids at each prompt's positions (the model as it is now,
    edits included), one 1-D int64 tensor per prompt, in order."""
    out = []
    with torch.no_grad():
        for _, mask, hidden, positions in prompts.batches:
            logits = model.forward_from(hidden, mask, start_block=prompts.start_block)
            top = logits.argmax(-1)
            out += [top[row, pos] for row, pos in enumerate(positions)]
    return out
