"""Packed sequences: several documents in one row, kept apart by document ids.

A packed row holds documents back to back; ``doc_ids [B, S]`` gives each position's document
(any integers; the positions of one document share one id and are contiguous). Attention is causal *within* a document only (block-diagonal causal mask, as
FlashAttention's varlen kernels or HF's packed ``position_ids`` give), and the
sequence-level balance loss treats every (row, document) as one sequence.

Positions are not restarted per document: RoPE scores depend only on the distance between
query and key, so a document at offset o attends exactly as at offset 0 (up to float
rounding of the rotation angles). Routers that rank over a whole sequence (USMoE, expert
choice) still see the packed row (a documented limitation).
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_attention_mask(doc_ids: Tensor, attn_mask: Tensor | None) -> Tensor:
    """Bool ``[B, 1, S, S]`` mask (True = may attend): key ``j`` is visible to query ``i`` iff
    ``j <= i``, ``doc_ids[b, j] == doc_ids[b, i]`` and ``attn_mask`` allows it (padding).

    Every query sees itself (so fully padded queries give finite values).

    Args:
        doc_ids: ``[B, S]`` integer document id of each position.
        attn_mask: the causal/padding mask ``[B or 1, 1, S, S]`` or None (plain causal).
    """
    S = doc_ids.shape[1]
    pos = torch.arange(S, device=doc_ids.device)
    causal = pos[None, :] <= pos[:, None]  # [S(q), S(k)]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, S(q), S(k)]
    allowed = same & causal
    if attn_mask is not None:
        allowed = allowed & attn_mask[:, 0]
    allowed = allowed | (pos[None, :] == pos[:, None])
    return allowed[:, None]


def segment_ids(doc_ids: Tensor) -> Tensor:
    """``[B·S]`` int64 segment of every token for the sequence-level losses: one segment per
    (row, document), numbered ``row·S + first position of the document``, so ids lie in
    ``[0, B·S)`` and are found without a host sync. Documents must be contiguous runs of
    equal ids within a row (standard packing).
    """
    B, S = doc_ids.shape
    pos = torch.arange(S, device=doc_ids.device).expand(B, S)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, pos, 0).cummax(dim=1).values  # last document start <= i
    return (torch.arange(B, device=doc_ids.device)[:, None] * S + first).reshape(-1)
