"""The expert-masking (bypass) attack: at inference, per MoE layer, the ``m`` experts that
carry the most routing mass on harmful prompts are never selected (their selection bias is
−∞), and the model is measured again (in the spirit of F-SOUR-style routing attacks).

Masking goes through the router's selection bias (``expert_bias``, used by top-k selection
only; combine weights come from the unbiased scores, renormalised over the experts that
remain), so the masked experts are never chosen and each token's weights still sum to 1 with
``norm_topk_prob``. A router without an ``expert_bias`` buffer gets a temporary one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from moelab.core.routers import TopKRouter
from moelab.errors import InvalidValueError
from moelab.models.transformer import MoETransformer


@contextmanager
def masked_experts(model: MoETransformer, experts: Mapping[int, Sequence[int]]) -> Iterator[None]:
    """Within the block, the routers of MoE blocks ``experts`` (block index → expert ids)
    never select those experts; the routers are restored on exit.

    Raises:
        InvalidValueError: a block that is not an MoE layer with a token-choice router, an
            expert id out of range, or as many masked experts as the layer has minus top-k
            (a token would have fewer than k experts left).
    """
    saved = []
    try:
        for layer, ids in experts.items():
            block = model.blocks[layer] if 0 <= layer < len(model.blocks) else None
            if block is None or not block.is_moe or not isinstance(block.ffn.router, TopKRouter):
                raise InvalidValueError(f"experts: block {layer} has no token-choice MoE router")
            router = block.ffn.router
            E, k = router.config.num_experts, router.config.top_k
            ids = sorted(set(ids))
            if any(not 0 <= e < E for e in ids) or E - len(ids) < k:
                raise InvalidValueError(
                    f"experts: block {layer} can mask at most {E - k} of ids [0, {E}), got {ids}"
                )
            old = router.expert_bias
            bias = torch.zeros(E) if old is None else old.clone()
            bias[ids] = float("-inf")
            saved.append((router, None if old is None else old.clone()))
            if old is None:
                router.expert_bias = bias
            else:
                old.copy_(bias)
        yield
    finally:
        for router, old in saved:
            if old is None:
                router.expert_bias = None
            else:
                router.expert_bias.copy_(old)
