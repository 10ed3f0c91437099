"""Block-diffusion MoE LM: the MoE transformer with a mask token and block-causal attention.

Follows SDAR (arXiv 2510.06303) and BD3-LM (Arriola et al., ICLR 2025, arXiv 2503.09573):
the sequence is cut into blocks of ``b = cfg.block_size`` tokens at absolute positions
``[j·b, (j+1)·b)``; attention is bidirectional inside a block and causal across blocks (a
query at position ``q`` sees key position ``k`` iff ``k // b <= q // b``), so finished blocks
are served from a KV cache and the current block is denoised in parallel.

The same :class:`~moelab.models.MoETransformer` weights are used (``cfg.objective =
"block_diffusion"``); its causal ``forward`` refuses such a model. This module gives:

- :func:`block_causal_mask` / :func:`bd3_training_mask`: the attention patterns;
- :func:`diffusion_forward`: one forward with explicit positions, a bool attention mask, an
  optional :class:`PrefixKV` (finished blocks) and an optional per-MoE-layer hook (what the
  TEAM decoders use to cache or restrict expert computation);
- :func:`to_block_diffusion`: an AR model turned into a block-diffusion one (AR init).

Our choices (labelled; the papers leave them open or differ):

- The mask token is a NEW last id (``vocab_size`` grows by one). Its embedding starts as the
  mean of the AR model's embeddings and its LM-head row as zeros; decoders never emit it.
- No logit shift: the logits at position i predict the token at position i (LLaDA / BD3-LM
  convention), not i+1 as in the AR model (Dream / SDAR-style shifting is not done).
- Training uses the BD3-LM two-copy layout: ``[x_t ; x_0]`` of length ``2S`` with shared
  positions; noised block j sees itself and clean blocks < j, clean block j sees clean
  blocks <= j. Every block gets a loss in one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidValueError
from moelab.models.block import DecoderBlock
from moelab.models.config import ModelConfig
from moelab.models.transformer import MoETransformer

MoEHook = Callable[[int, DecoderBlock, Tensor], Tensor]
"""``hook(layer_idx, block, x [T, D]) -> y [T, D]``: replaces ``block.ffn`` of MoE layers."""


def block_causal_mask(q_pos: Tensor, k_pos: Tensor, block_size: int) -> Tensor:
    """Bool ``[Sq, Sk]``: query at absolute position ``q_pos[i]`` may attend key ``k_pos[j]``
    iff ``k_pos[j] // block_size <= q_pos[i] // block_size`` (bidirectional inside a block,
    causal across blocks). ``q_pos``, ``k_pos``: 1-D int64."""
    if block_size < 1:
        raise InvalidValueError(f"block_size: must be >= 1, got {block_size}")
    return (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)


def bd3_training_mask(seq_len: int, block_size: int, device=None) -> Tensor:
    """Bool ``[2S, 2S]`` mask of the two-copy training input ``[x_t ; x_0]`` (BD3-LM):
    noised query in block j sees noised keys of block j and clean keys of blocks < j; clean
    query in block j sees clean keys of blocks <= j; clean queries never see noised keys.

    Raises:
        ValueError: ``seq_len`` not a multiple of ``block_size``.
    """
    if seq_len % block_size:
        raise InvalidValueError(f"seq_len: {seq_len} is not a multiple of block_size={block_size}")
    blk = torch.arange(seq_len, device=device) // block_size
    same = blk[None, :] == blk[:, None]
    before = blk[None, :] < blk[:, None]
    upto = blk[None, :] <= blk[:, None]
    none = torch.zeros_like(same)
    top = torch.cat([same, before], dim=1)
    bottom = torch.cat([none, upto], dim=1)
    return torch.cat([top, bottom], dim=0)


@dataclass
class PrefixKV:
    """Keys/values of the finished blocks, per layer ``[B, Hkv, P, hd]`` (RoPE applied)."""

    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0


@dataclass
class DiffusionOutput:
    """One :func:`diffusion_forward`: ``logits [B, S, V]``, aux-loss sum (fp32 scalar; 0
    without grad), per-layer records (None for dense layers or hooked MoE layers), and the new
    keys/values ``[B, Hkv, S, hd]`` per layer (appended to the prefix when ``store=True``)."""

    logits: Tensor
    aux_loss: Tensor
    records: list[RoutingRecord | None]
    new_k: list[Tensor]
    new_v: list[Tensor]


def check_diffusion_model(model: MoETransformer) -> None:
    """Raise ``ValueError`` unless ``model`` is a block-diffusion model."""
    if model.cfg.objective != "block_diffusion":
        raise InvalidValueError(
            f"model: objective is {model.cfg.objective!r}; the block-diffusion path needs a "
            "block_diffusion model (moelab train --objective block-diffusion --init-from RUN)"
        )


def diffusion_forward(
    model: MoETransformer,
    input_ids: Tensor,
    positions: Tensor,
    attn_mask: Tensor,
    *,
    prefix: PrefixKV | None = None,
    store: bool = False,
    moe_hook: MoEHook | None = None,
) -> DiffusionOutput:
    """Logits of ``input_ids [B, S]`` at absolute ``positions [S]`` (int64; repeats allowed).

    Args:
        attn_mask: bool ``[S, P+S]`` or ``[B, 1, S, P+S]`` (True = may attend) over the
            ``P = prefix.length`` cached keys followed by this call's keys.
        prefix: finished blocks' keys/values (None = nothing cached).
        store: append this call's keys/values to ``prefix`` (a finished block).
        moe_hook: computes the MoE layers instead of ``block.ffn`` (see :data:`MoEHook`).

    Raises:
        ValueError: not a block-diffusion model, bad shapes, ids or positions out of range.
    """
    check_diffusion_model(model)
    cfg = model.cfg
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise InvalidValueError(
            f"input_ids: must be an integer tensor [B, S], got {input_ids.shape}"
        )
    S = input_ids.shape[1]
    if positions.shape != (S,):
        raise InvalidValueError(f"positions: must be [S={S}], got {tuple(positions.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size:
        raise InvalidValueError(f"input_ids: ids must be in [0, vocab_size={cfg.vocab_size})")
    P = prefix.length if prefix is not None else 0
    if attn_mask.dtype != torch.bool or tuple(attn_mask.shape[-2:]) != (S, P + S):
        raise InvalidValueError(
            f"attn_mask: must be bool [..., {S}, {P + S}], got {attn_mask.shape}"
        )
    mask4 = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]
    x = model.embed(input_ids)
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    records: list[RoutingRecord | None] = []
    new_k: list[Tensor] = []
    new_v: list[Tensor] = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = attn.project(block.attn_norm(x))
        q, k = attn.rope.at(q, k, positions)
        new_k.append(k)
        new_v.append(v)
        if P:
            k = torch.cat([prefix.k[i], k], dim=2)
            v = torch.cat([prefix.v[i], v], dim=2)
        h = x + attn.attend(q, k, v, mask4)
        hn = block.ffn_norm(h)
        if block.is_moe and moe_hook is not None:
            y = moe_hook(i, block, hn.reshape(-1, hn.shape[-1])).reshape(hn.shape).to(h.dtype)
            records.append(None)
        elif block.is_moe:
            out = block.ffn(hn)
            y = out.hidden_states
            for value in out.aux_losses.values():
                aux = aux + value.float()
            records.append(out.record)
        else:
            y = block.ffn(hn)
            records.append(None)
        x = h + y
    logits = model.lm_head(model.norm(x))
    if model.cfg.logit_scale != 1.0:
        logits = logits * model.cfg.logit_scale
    if store:
        if prefix is None:
            raise InvalidValueError("store: needs a prefix to append to")
        if not prefix.k:
            prefix.k, prefix.v = list(new_k), list(new_v)
        else:
            prefix.k = [torch.cat(p, dim=2) for p in zip(prefix.k, new_k, strict=True)]
            prefix.v = [torch.cat(p, dim=2) for p in zip(prefix.v, new_v, strict=True)]
    return DiffusionOutput(logits, aux, records, new_k, new_v)


@torch.no_grad()
def to_block_diffusion(model: MoETransformer, block_size: int) -> MoETransformer:
    """A block-diffusion copy of causal ``model`` (AR initialisation): same weights, the
    vocabulary grown by one mask id (embedding = mean embedding, LM-head row = zeros).

    Raises:
        ValueError: ``model`` is already a block-diffusion model, or a bad ``block_size``.
    """
    if model.cfg.objective != "causal":
        raise InvalidValueError("model: already a block-diffusion model")
    d = model.cfg.to_dict()
    d.update(objective="block_diffusion", block_size=block_size, vocab_size=d["vocab_size"] + 1)
    new = MoETransformer(ModelConfig.from_dict(d)).to(model.embed.weight.device)
    state = model.state_dict()
    for name in ("embed.weight", "lm_head.weight"):
        old = state[name]
        row = old.mean(0, keepdim=True) if name == "embed.weight" else torch.zeros_like(old[:1])
        state[name] = torch.cat([old, row], dim=0)
    new.load_state_dict(state)  # strict: every shape, the extra mask row included, must fit
    return new.to(model.embed.weight.dtype)
