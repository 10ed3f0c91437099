"""Load-balancing losses (Switch Transformer, Fedus et al. 2021, arXiv 2101.03961, eq. 4).

``L = E · Σ_i f_i · P_i`` with ``P_i`` the mean router probability of expert i over valid tokens
and ``f_i`` the fraction of routed pairs that went to expert i. All variants count the pairs
actually dispatched (after bias, group limits and capacity dropping) and use the router's own
distribution (``RoutingPlan.probs``: softmax, or normalised sigmoid scores).

Conventions for f (``LossConfig.convention``):
- ``"megatron"`` (default; Megatron-Core, MegaBlocks, OLMo-core): ``f_i = count_i / N`` with
  N = pairs (T·k for token choice), so perfectly balanced routing gives exactly 1.0.
- ``"hf"`` (transformers ``load_balancing_loss_func``): ``f_i = count_i / T``, so balanced
  routing gives k. (transformers also pools all layers into one loss; moelab always computes
  the loss per layer, the fix asked for in transformers#28255.)

Variants:
- :class:`SwitchBalanceLoss`: over the micro-batch.
- :class:`SequenceBalanceLoss`: per sequence, then averaged over sequences (DeepSeek-V3
  eq. 17–20, Megatron ``seq_aux_loss``).
- :class:`GlobalBalanceLoss`: f from counts summed over data-parallel ranks and over the
  micro-batches of the current optimizer step, P local (Qiu et al., "Demons in the Detail",
  arXiv 2501.11873; Megatron ``global_aux_loss``). Micro-batch counts are committed outside
  forward (:meth:`GlobalBalanceLoss.commit`), so activation checkpointing cannot count a
  micro-batch twice; :meth:`GlobalBalanceLoss.reset` after each optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moelab.core.config import LossConfig
from moelab.core.plan import RoutingPlan


def switch_balance_loss(
    probs_TE: Tensor,
    counts_E: Tensor,
    token_mask: Tensor,
    convention: str = "megatron",
    total_tokens: Tensor | None = None,
) -> Tensor:
    """``E · Σ_i f_i P_i`` for one group of tokens.

    Args:
        probs_TE: ``[T, E]`` float32 router distribution.
        counts_E: ``[E]`` integer pairs per expert (valid tokens only).
        token_mask: ``[T]`` bool valid tokens.
        convention: ``"megatron"`` (f = count/N) or ``"hf"`` (f = count/T).
        total_tokens: T of the ``"hf"`` denominator when counts cover more tokens than
            ``token_mask`` (global batch); defaults to the valid tokens of ``token_mask``.
    Returns:
        float32 scalar; 0 when there is no valid token or pair.
    """
    E = probs_TE.shape[-1]
    n_tokens = token_mask.sum()
    if convention == "megatron":
        denom = counts_E.sum()
    else:
        denom = n_tokens if total_tokens is None else total_tokens
    f = counts_E.float() / denom.clamp_min(1)
    P = (probs_TE * token_mask.unsqueeze(-1)).sum(0) / n_tokens.clamp_min(1)
    return E * (f * P).sum()


class SwitchBalanceLoss:
    """Switch load-balancing loss over the whole micro-batch."""

    def __init__(self, convention: str = "megatron") -> None:
        self.convention = convention

    def __call__(
        self,
        plan: RoutingPlan,
        token_mask: Tensor,
        batch_shape: tuple[int, ...],
        segment_ids: Tensor | None = None,  # micro-batch level: documents do not matter
    ) -> Tensor:
        return switch_balance_loss(plan.probs, plan.counts(token_mask), token_mask, self.convention)


class SequenceBalanceLoss:
    """Per-sequence balance, averaged over sequences that have at least one valid token.

    The layer input's leading shape ``(B, S)`` defines the sequences; a 2-D ``[T, D]`` input is
    one sequence. With ``segment_ids`` ``[T]`` int64 in ``[0, T)`` (packed documents,
    :func:`moelab.models.packing.segment_ids`) every segment is a sequence instead.
    """

    def __init__(self, convention: str = "megatron") -> None:
        self.convention = convention

    def __call__(
        self,
        plan: RoutingPlan,
        token_mask: Tensor,
        batch_shape: tuple[int, ...],
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        E = plan.num_experts
        if segment_ids is not None:
            return self._per_segment(plan, token_mask, segment_ids)
        B = batch_shape[0] if len(batch_shape) >= 2 else 1
        S = plan.num_tokens // max(B, 1)
        seq_of_token = torch.arange(plan.num_tokens, device=token_mask.device) // max(S, 1)
        valid_pair = token_mask[plan.token_idx]
        seq_pair = seq_of_token[plan.token_idx][valid_pair]
        counts_BE = torch.bincount(
            seq_pair * E + plan.expert_idx[valid_pair], minlength=B * E
        ).view(B, E)
        mask_BS = token_mask.view(B, S)
        n_tok = mask_BS.sum(1)
        denom = counts_BE.sum(1) if self.convention == "megatron" else n_tok
        f = counts_BE.float() / denom.clamp_min(1).unsqueeze(1)
        P = (plan.probs.view(B, S, E) * mask_BS.unsqueeze(-1)).sum(1) / n_tok.clamp_min(
            1
        ).unsqueeze(1)
        per_seq = E * (f * P).sum(1)
        has_tokens = n_tok > 0
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1)

    def _per_segment(self, plan: RoutingPlan, token_mask: Tensor, seg: Tensor) -> Tensor:
        E, T = plan.num_experts, plan.num_tokens
        G = T  # segment ids lie in [0, T); empty segments are skipped
        valid_pair = token_mask[plan.token_idx].long()
        slot = seg[plan.token_idx] * E + plan.expert_idx  # scatter-add: no host sync
        counts = torch.zeros(G * E, dtype=torch.long, device=seg.device)
        counts = counts.scatter_add_(0, slot, valid_pair).view(G, E)
        n_tok = torch.zeros(G, dtype=torch.long, device=seg.device).index_add(
            0, seg, token_mask.long()
        )
        denom = counts.sum(1) if self.convention == "megatron" else n_tok
        f = counts.float() / denom.clamp_min(1).unsqueeze(1)
        p_sum = torch.zeros(G, E, dtype=plan.probs.dtype, device=seg.device).index_add(
            0, seg, plan.probs * token_mask.unsqueeze(-1)
        )
        P = p_sum / n_tok.clamp_min(1).unsqueeze(1)
        per_seq = E * (f * P).sum(1)
        has_tokens = n_tok > 0
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1)


class GlobalBalanceLoss:
    """Global-batch balance: counts accumulated over micro-batches and data-parallel ranks.

    Forward never accumulates: it uses the counts *committed* by earlier micro-batches plus
    its own (all-reduced) counts, and only remembers its own counts as ``pending``
    (overwritten, so a recomputed forward under activation checkpointing leaves the same
    state). The training loop calls :meth:`commit` once after each micro-batch and
    :meth:`reset` after each optimizer step (:meth:`moelab.core.layer.MoELayer.end_micro_batch`
    and ``reset_loss_state``). Without commits, every micro-batch uses its own DP-global
    counts.
    """

    def __init__(self, convention: str = "megatron") -> None:
        self.convention = convention
        self.counts: Tensor | None = None
        self.tokens: Tensor | None = None
        self.pending: tuple[Tensor, Tensor] | None = None

    def reset(self) -> None:
        """Forget the accumulated counts (call once per optimizer step)."""
        self.counts = None
        self.tokens = None
        self.pending = None

    def commit(self) -> None:
        """Add the last forward's counts to the step's accumulated counts (call once per
        micro-batch, outside forward)."""
        if self.pending is None:
            return
        counts, tokens = self.pending
        if self.counts is not None and self.counts.shape == counts.shape:
            counts, tokens = counts + self.counts, tokens + self.tokens
        self.counts, self.tokens = counts, tokens
        self.pending = None

    def __call__(
        self,
        plan: RoutingPlan,
        token_mask: Tensor,
        batch_shape: tuple[int, ...],
        segment_ids: Tensor | None = None,  # global batch: documents do not matter
    ) -> Tensor:
        counts = plan.counts(token_mask)
        tokens = token_mask.sum().reshape(1)
        if dist.is_available() and dist.is_initialized():
            stacked = torch.cat([counts, tokens.to(counts.dtype)])
            dist.all_reduce(stacked)
            counts, tokens = stacked[:-1], stacked[-1:]
        self.pending = (counts.detach(), tokens.detach())
        if self.counts is not None and self.counts.shape == counts.shape:
            counts, tokens = counts + self.counts, tokens + self.tokens
        return switch_balance_loss(plan.probs, counts, token_mask, self.convention, tokens.sum())


_LOSSES = {"switch": SwitchBalanceLoss, "seq": SequenceBalanceLoss, "global": GlobalBalanceLoss}


def build_balance_loss(config: LossConfig):
    """The balance-loss object named by ``config.load_balance`` (None for ``"none"``)."""
    if config.load_balance == "none":
        return None
    return _LOSSES[config.load_balance](config.convention)
