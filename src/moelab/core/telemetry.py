"""RoutingRecord: what one MoE layer did in one forward pass, detached, for logs and analysis."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan


@dataclass(frozen=True)
class RoutingRecord:
    """Detached routing telemetry of one layer call (padding excluded where a mask was given).

    Attributes:
        counts: ``[E]`` int64 pairs routed to each expert (valid tokens only).
        dropped: pairs dropped by capacity.
        mean_probs: ``[E]`` float32 mean router probability per expert over valid tokens.
        entropy: mean per-token routing entropy in nats, ``-Σ_e p log p`` of ``probs``.
        token_idx, expert_idx, weight: ``[N]`` the dispatched pairs (valid tokens only).
        probs: ``[T, E]`` float32 per-token router distribution (all tokens).
        token_mask: ``[T]`` bool, True for real (non-padding) tokens.
        batch_shape: leading shape of the layer input, e.g. ``(B, S)``; ``prod = T``.
    """

    counts: Tensor
    dropped: int
    mean_probs: Tensor
    entropy: float
    token_idx: Tensor
    expert_idx: Tensor
    weight: Tensor
    probs: Tensor
    token_mask: Tensor
    batch_shape: tuple[int, ...]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def top1(self) -> Tensor:
        """``[T]`` int64 highest-probability expert of every token."""
        return self.probs.argmax(dim=-1)

    @property
    def load_imbalance(self) -> float:
        """max/mean expert load (1.0 = perfectly balanced; 0.0 when nothing was routed)."""
        c = self.counts.float()
        mean = c.mean().item()
        return c.max().item() / mean if mean > 0 else 0.0

    @classmethod
    def from_plan(
        cls, plan: RoutingPlan, token_mask: Tensor, batch_shape: tuple[int, ...]
    ) -> RoutingRecord:
        """Summarise ``plan`` over the tokens where ``token_mask`` ``[T]`` is True."""
        with torch.no_grad():
            probs = plan.probs.detach().float()
            keep = token_mask[plan.token_idx]
            valid = probs[token_mask]
            n_valid = valid.shape[0]
            if n_valid:
                mean_probs = valid.mean(0)
                entropy = -(valid * valid.clamp_min(1e-30).log()).sum(-1).mean().item()
            else:
                mean_probs = torch.zeros(plan.num_experts)
                entropy = 0.0
            return cls(
                counts=plan.counts(token_mask),
                dropped=plan.dropped,
                mean_probs=mean_probs,
                entropy=entropy,
                token_idx=plan.token_idx[keep],
                expert_idx=plan.expert_idx[keep],
                weight=plan.weight.detach()[keep],
                probs=probs,
                token_mask=token_mask,
                batch_shape=tuple(batch_shape),
            )
