"""The masked block-diffusion objective (SDAR / BD3-LM / LLaDA) and its ELBO in bits per byte.

For clean tokens ``x_0 [B, S]`` cut into blocks of ``b`` tokens, each (sequence, block) draws a
mask ratio ``t ~ U(t_min, 1)``; every token of the block is replaced by the mask id with
probability ``t``. The model sees ``[x_t ; x_0]`` (:func:`moelab.models.block_diffusion.
bd3_training_mask`) and the loss is the negative ELBO of masked diffusion (LLaDA Eq. 3, BD3-LM
Eq. 8):

    L = (1 / (B·S)) · Σ_{masked i} CE(logits_i, x0_i) / t_block(i)

in nats per token; summed (not divided by ``B·S``) it is an upper bound on ``-log p(x_0)``,
which :func:`diffusion_nats` returns for evaluation (one Monte-Carlo draw of ``t`` and masks
per block, seeded). Choice: ``t_min = 1e-3`` (avoids the 1/t blow-up; BD3-LM clips similarly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.models import MoETransformer
from moelab.models.block_diffusion import bd3_training_mask, diffusion_forward

T_MIN = 1e-3


def noise_blocks(
    x0: Tensor, block_size: int, mask_id: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``x0 [B, S]`` → ``(x_t [B, S], masked [B, S] bool, t [B, S] float32)`` with one ratio
    ``t ~ U(T_MIN, 1)`` per (sequence, block), repeated over the block's tokens.

    Raises:
        ValueError: ``S`` is not a multiple of ``block_size``.
    """
    B, S = x0.shape
    if S % block_size:
        raise ValueError(f"seq_len: {S} is not a multiple of block_size={block_size}")
    nb = S // block_size
    t = torch.rand(B, nb, generator=generator, device=x0.device) * (1 - T_MIN) + T_MIN
    t = t.repeat_interleave(block_size, dim=1)
    masked = torch.rand(B, S, generator=generator, device=x0.device) < t
    return x0.masked_fill(masked, mask_id), masked, t


def diffusion_loss_terms(
    model: MoETransformer, x0: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, list]:
    """``(nats_sum, aux_loss, records)``: ``nats_sum`` = fp32 scalar Σ masked CE / t over
    the batch (the summed negative ELBO in nats), aux losses of the MoE layers."""
    cfg = model.cfg
    B, S = x0.shape
    xt, masked, t = noise_blocks(x0, cfg.block_size, cfg.mask_token_id, generator)
    pos = torch.arange(S, device=x0.device)
    out = diffusion_forward(
        model,
        torch.cat([xt, x0], dim=1),
        torch.cat([pos, pos]),
        bd3_training_mask(S, cfg.block_size, x0.device),
    )
    logits = out.logits[:, :S].float()
    ce = F.cross_entropy(logits.flatten(0, 1), x0.flatten(), reduction="none").view(B, S)
    nats = (ce * masked / t).sum()
    return nats, out.aux_loss, out.records


def diffusion_nats(model: MoETransformer, x0: Tensor, seed: int = 0) -> float:
    """Negative ELBO of ``x0 [B, S]`` in nats (summed over tokens; seeded draw)."""
    g = torch.Generator(device=x0.device).manual_seed(seed)
    with torch.no_grad():
        return diffusion_loss_terms(model, x0, g)[0].item()


def batch_elbo_nats(model: MoETransformer, batch) -> float:
    """``evaluate(nats_fn=...)`` score of a block-diffusion model: the summed negative ELBO of
    ``batch.targets`` (seed 0), in nats."""
    return diffusion_nats(model, batch.targets, seed=0)
