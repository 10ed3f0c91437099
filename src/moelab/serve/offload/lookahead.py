"""Next-layer expert prediction from the router itself (the speculative expert loading of
Eliseev & Mazur, arXiv 2312.17238): when MoE layer ``l`` is about to run, the next MoE layer's
router is applied to layer ``l``'s hidden state; the residual stream changes little between layers, so
its top experts are likely the ones layer ``l+1`` will pick. The offload engine prefetches them
while layer ``l`` loads and computes.

This is not part of ZipMoE (whose optional predictor, :mod:`moelab.serve.offload.prefetch`,
uses routing history only); it gives the single-queue storage work to do while the forward
pass computes, which at batch 1 nothing else can.

Our choices [I]: the guess is the next layer's pre-FFN norm and router logits on the
post-attention hidden state of layer ``l`` (the input of layer ``l``'s FFN norm); experts are
ranked by how many rows put them in their top-k of the logits (ties by the summed logits), so
routers that select otherwise (bias-adjusted, expert choice) are approximated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn


def guess_experts(block: nn.Module, h: Tensor, n: int) -> list[int]:
    """The ``n`` experts ``block``'s router would most likely give rows of ``h [..., D]``."""
    router = block.ffn.router
    logits = router.logits(block.ffn_norm(h).reshape(-1, h.shape[-1])).float()
    k = min(router.config.top_k, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices.reshape(-1)
    votes = torch.bincount(top, minlength=logits.shape[-1])
    by_logit = logits.sum(0).argsort(descending=True, stable=True)  # the tie-break
    order = by_logit[votes[by_logit].argsort(descending=True, stable=True)][:n]
    return [int(e) for e in order if votes[e] > 0]


def install(model: nn.Module, hint: Callable[[int, list[int]], None], n: int) -> None:
    """Hook every MoE block but the last so that, before its FFN runs, ``hint(i + 1, experts)``
    receives the guess for MoE layer ``i + 1`` (MoE layers counted from 0)."""
    blocks = [b for b in model.blocks if b.is_moe]
    for i, (block, nxt) in enumerate(itertools.pairwise(blocks)):

        def guess(module, args, i=i, nxt=nxt):
            with torch.no_grad():
                hint(i + 1, guess_experts(nxt, args[0], n))

        block.ffn_norm.register_forward_pre_hook(guess)
