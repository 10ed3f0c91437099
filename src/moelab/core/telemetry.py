"""RoutingRecord: what one MoE layer did in one forward pass, detached, for logs and analysis.

The record keeps references to the (detached) plan tensors and computes its statistics only
when they are read, so the forward pass pays nothing for telemetry nobody looks at.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan


@dataclass(frozen=True)
class RoutingRecord:
    """Detached routing telemetry of one layer call (padding excluded where a mask was given).

    Attributes:
        all_token_idx, all_expert_idx, all_weight: ``[N]`` every dispatched pair.
        probs: ``[T, E]`` float32 per-token router distribution (all tokens).
        token_mask: ``[T]`` bool, True for real (non-padding) tokens.
        padded: False when every token is real (lets the derived values skip masking).
        dropped: pairs dropped by capacity.
        batch_shape: leading shape of the layer input, e.g. ``(B, S)``; ``prod = T``.

    Derived (computed on first access): ``counts`` ``[E]`` int64 pairs per expert,
    ``mean_probs`` ``[E]`` mean router probability per expert, ``entropy`` mean per-token
    routing entropy in nats (``-Σ_e p log p``), and ``token_idx``/``expert_idx``/``weight``,
    the pairs of valid tokens only.
    """

    all_token_idx: Tensor
    all_expert_idx: Tensor
    all_weight: Tensor
    probs: Tensor
    token_mask: Tensor
    dropped: int
    batch_shape: tuple[int, ...]
    padded: bool = True

    @classmethod
    def from_plan(
        cls,
        plan: RoutingPlan,
        token_mask: Tensor,
        batch_shape: tuple[int, ...],
        padded: bool = True,
    ) -> RoutingRecord:
        """Record ``plan``; ``token_mask`` ``[T]`` bool marks real tokens; ``padded=False``
        promises it is all True."""
        return cls(
            all_token_idx=plan.token_idx.detach(),
            all_expert_idx=plan.expert_idx.detach(),
            all_weight=plan.weight.detach(),
            probs=plan.probs.detach(),
            token_mask=token_mask,
            dropped=plan.dropped,
            batch_shape=tuple(batch_shape),
            padded=padded,
        )

    @property
    def num_experts(self) -> int:
        return self.probs.shape[-1]

    @cached_property
    def _valid_pairs(self) -> Tensor | None:
        return self.token_mask[self.all_token_idx] if self.padded else None

    def _pairs(self, t: Tensor) -> Tensor:
        keep = self._valid_pairs
        return t if keep is None else t[keep]

    @cached_property
    def token_idx(self) -> Tensor:
        return self._pairs(self.all_token_idx)

    @cached_property
    def expert_idx(self) -> Tensor:
        return self._pairs(self.all_expert_idx)

    @cached_property
    def weight(self) -> Tensor:
        return self._pairs(self.all_weight)

    @cached_property
    def counts(self) -> Tensor:
        return torch.bincount(self.expert_idx, minlength=self.num_experts)

    @cached_property
    def _valid_probs(self) -> Tensor:
        probs = self.probs.float()
        return probs[self.token_mask] if self.padded else probs

    @cached_property
    def mean_probs(self) -> Tensor:
        valid = self._valid_probs
        return valid.mean(0) if valid.shape[0] else torch.zeros(self.num_experts)

    @cached_property
    def entropy(self) -> float:
        valid = self._valid_probs
        if not valid.shape[0]:
            return 0.0
        return -(valid * valid.clamp_min(1e-30).log()).sum(-1).mean().item()

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
