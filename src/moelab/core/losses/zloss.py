"""Router z-loss (Zoph et al., "ST-MoE", arXiv 2202.08906, eq. 5)."""

from __future__ import annotations

import torch
from torch import Tensor


def router_z_loss(logits_TE: Tensor, token_mask: Tensor) -> Tensor:
    """``mean_t (logsumexp_e logits[t, e])²`` over valid tokens (Megatron ``z_loss_func``).

    Args:
        logits_TE: ``[T, E]`` float32 router logits.
        token_mask: ``[T]`` bool, True for real tokens.
    Returns:
        float32 scalar, 0 when no token is valid (still attached to the graph).
    """
    z = torch.logsumexp(logits_TE, dim=-1).square()
    n = token_mask.sum()
    return (z * token_mask).sum() / n.clamp_min(1)
