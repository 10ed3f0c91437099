"""One candidate growth site of selective upcycling: a block's feed-forward network, dense
until it is grown, then an MoE layer with one expert per task that grew it
(:mod:`moelab.models.bert_moe`), and the encoder forward that runs a site in place of each
block's FFN.

During the selective search the newest expert of a site is on trial: the site's output is
``(1 − m)·keep(a) + m·grow(a)`` with ``m`` the Gumbel mask's 0/1 straight-through sample
(``wave3-continual.md`` §5.2 [I]), ``keep`` the site as it was before the task (the dense FFN,
or the MoE layer with the newest router logit at −∞) and ``grow`` the MoE layer with it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moelab.core.layer import MoELayer
from moelab.models.bert_moe import (
    drop_newest,
    freeze_all,
    grow_copy,
    moe_forward,
    moe_from_bert_ffn,
)
from moelab.models.encoder import BertEncoder, BertFFN, pool


class GrowthSite(nn.Module):
    """A block's FFN: ``dense`` (a copy of the pretrained FFN; trainable only for sequential
    fine-tuning) and, once grown, ``moe`` (expert 0 = the pretrained FFN, frozen; one expert
    per growth).

    Forward: ``a [B, S, D]``, ``mask [B, S]`` bool, ``gate`` None (the site as it is) or a
    scalar tensor (the newest expert on trial, see the module docstring) → ``[B, S, D]``.
    """

    def __init__(self, ffn: BertFFN, trainable: bool) -> None:
        super().__init__()
        self.dense = copy.deepcopy(ffn).requires_grad_(trainable)
        self.moe: MoELayer | None = None

    @property
    def num_experts(self) -> int:
        """Experts of the site (1 while dense)."""
        return 1 if self.moe is None else self.moe.experts.num_experts

    def grow(self) -> None:
        """Add one trainable expert copied from the pretrained FFN (and a zero router row)."""
        if self.moe is None:
            self.moe = moe_from_bert_ffn(self.dense)
        else:
            grow_copy(self.moe)

    def reject(self) -> None:
        """Remove the newest expert (a growth the search rejected)."""
        if self.num_experts == 2:
            self.moe = None
        else:
            drop_newest(self.moe)

    def settle(self) -> None:
        """Freeze every expert (after a task; the router stays trainable)."""
        if self.moe is not None:
            freeze_all(self.moe)

    def forward(self, a: Tensor, mask: Tensor, gate: Tensor | None = None) -> Tensor:
        if self.moe is None:
            return self.dense(a)
        grow = moe_forward(self.moe, a, mask, exclude_newest=False)
        if gate is None:
            return grow
        keep = self.dense(a) if self.num_experts == 2 else moe_forward(self.moe, a, mask, True)
        return keep + gate * (grow - keep)


def sites_forward(
    encoder: BertEncoder,
    hidden: Tensor,
    mask: Tensor,
    start_block: int,
    sites: Sequence[GrowthSite],
    gates: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Blocks ``start_block .. L-1`` of the frozen encoder with ``sites[i]`` in place of block
    ``start_block + i``'s FFN (post-LN BERT: ``a = LN₁(h + Attn(h))``, ``h = LN₂(a + site(a))``).

    Args:
        hidden: ``[B, S, D]`` states entering ``start_block`` (the prefix cache's).
        mask: ``[B, S]`` bool, True at real tokens.
        gates: ``[L - start_block]`` mask samples, or None (every site as it is).
    Returns:
        ``(mean-pooled last features [B, D], the mean-pooled output of every site's block
        [B, D] each, in block order)``.
    """
    bias = torch.zeros(mask.shape, dtype=hidden.dtype)
    bias.masked_fill_(~mask, torch.finfo(hidden.dtype).min)
    bias = bias[:, None, None, :]
    h, pooled = hidden, []
    for i, (block, site) in enumerate(zip(encoder.blocks[start_block:], sites, strict=True)):
        a = block.attn_norm(h + block.attn(h, bias))
        h = block.ffn_norm(a + site(a, mask, None if gates is None else gates[i]))
        pooled.append(pool(h, mask))
    return pooled[-1], pooled
