"""The frozen encoder with adapters on its top blocks, and the cache of the blocks below.

:class:`PrefixCache` runs the frozen blocks ``0 .. L-k-1`` once per text
(:meth:`moelab.models.encoder.BertEncoder.hidden_at`) and keeps each text's hidden states
entering block ``L-k``; a training step then runs only the top ``k`` adapted blocks
(:func:`adapted_forward`). ``k = L`` caches the embeddings and adapts every block.

:func:`adapted_forward` runs a post-LayerNorm BERT block with a module beside its
feed-forward network, CaRE's and AdaptFormer's parallel placement (``ffn_option="parallel"``
[C]): ``a = LN₁(x + Attn(x))``, ``h = LN₂(a + FFN(a) + adapter(a))``. The encoder stays in
eval mode (no dropout in the frozen backbone, as the authors' ViT with ``drop = 0``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.models.encoder import BertEncoder, Tokenize

BlockAdapter = Callable[[Tensor, Tensor], tuple[Tensor, object]]
"""``(a [B, S, D], mask [B, S] bool) → (delta [B, S, D], side output)`` for one block."""


def check_adapted_blocks(encoder: BertEncoder, adapted_blocks: int) -> int:
    """The first adapted block ``L - adapted_blocks``.

    Raises:
        InvalidValueError: ``adapted_blocks`` outside ``[1, L]`` (beyond the encoder's depth).
    """
    L = encoder.cfg.num_hidden_layers
    if not isinstance(adapted_blocks, int) or not 1 <= adapted_blocks <= L:
        raise InvalidValueError(
            f"adapted_blocks: must be in [1, {L}] (the encoder has {L} blocks), got "
            f"{adapted_blocks!r}"
        )
    return L - adapted_blocks


class PrefixCache:
    """Hidden states entering block ``start_block`` per text, each computed once.

    Args:
        encoder: the frozen encoder (put in eval mode here).
        tokenizer: texts → ``(ids, mask)``; its max length bounds the tokens kept.
        start_block: the first adapted block (0: the embeddings).
        batch_size: texts per forward while filling the cache.
    """

    def __init__(
        self, encoder: BertEncoder, tokenizer: Tokenize, start_block: int, batch_size: int = 64
    ) -> None:
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.start_block = start_block
        self.batch_size = batch_size
        self.dim = encoder.cfg.hidden_size
        self.states: dict[str, Tensor] = {}
        self.features: dict[str, Tensor] = {}  # frozen final features, filled by the learners

    def add(self, texts: Sequence[str]) -> None:
        """Compute the states of the texts not cached yet (shortest first, batched)."""
        todo = sorted(set(texts).difference(self.states), key=len)
        for s in range(0, len(todo), self.batch_size):
            chunk = todo[s : s + self.batch_size]
            ids, mask = self.tokenizer(chunk)
            h = self.encoder.hidden_at(ids, mask, block=self.start_block)
            for row, (text, n) in enumerate(zip(chunk, mask.sum(1).tolist(), strict=True)):
                self.states[text] = h[row, : int(n)].clone()

    def __len__(self) -> int:
        return len(self.states)

    def batch(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """``(hidden [B, S, D], mask [B, S] bool)`` of ``texts`` (cached ones), right-padded
        to the longest.

        Raises:
            KeyError: a text that was not added.
        """
        rows = [self.states[t] for t in texts]
        S = max(r.shape[0] for r in rows)
        h = torch.zeros(len(rows), S, self.dim)
        mask = torch.zeros(len(rows), S, dtype=torch.bool)
        for k, r in enumerate(rows):
            h[k, : r.shape[0]] = r
            mask[k, : r.shape[0]] = True
        return h, mask


def adapted_forward(
    encoder: BertEncoder,
    hidden: Tensor,
    mask: Tensor,
    start_block: int,
    adapters: Sequence[BlockAdapter | None],
) -> tuple[Tensor, list[object]]:
    """Run blocks ``start_block .. L-1`` with ``adapters[i]`` beside block
    ``start_block + i``'s FFN (None: the plain block).

    Returns:
        ``(last hidden states [B, S, D], side outputs of the adapters, in block order)``.
    Raises:
        InvalidValueError: ``len(adapters) != L - start_block``.
    """
    blocks = encoder.blocks[start_block:]
    if len(adapters) != len(blocks):
        raise InvalidValueError(
            f"adapters: {len(adapters)} given for {len(blocks)} blocks from {start_block}"
        )
    bias = torch.zeros(mask.shape, dtype=hidden.dtype)
    bias.masked_fill_(~mask, torch.finfo(hidden.dtype).min)
    bias = bias[:, None, None, :]
    h, sides = hidden, []
    for block, adapter in zip(blocks, adapters, strict=True):
        a = block.attn_norm(h + block.attn(h, bias))
        y = block.ffn(a)
        if adapter is not None:
            delta, side = adapter(a, mask)
            y = y + delta
            sides.append(side)
        h = block.ffn_norm(a + y)
    return h, sides
