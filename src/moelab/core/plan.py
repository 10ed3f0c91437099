"""RoutingPlan: the one data structure between routing and expert compute.

A plan is a flat list of N routed (token, expert, combine weight) pairs. Token choice gives
N = T·k, expert choice N = E·capacity, capacity dropping and variable budgets give fewer pairs:
nothing downstream assumes a fixed k per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.errors import InvalidTypeError, InvalidValueError


@dataclass(frozen=True)
class RoutingPlan:
    """Routed pairs plus the router state the losses and telemetry need.

    Attributes:
        token_idx: ``[N]`` int64, index into the flattened ``[T, D]`` tokens.
        expert_idx: ``[N]`` int64 in ``[0, E)``.
        weight: ``[N]`` float32 combine weights (differentiable w.r.t. the router).
        logits: ``[T, E]`` float32 router logits (before bias, jitter-free at eval).
        probs: ``[T, E]`` float32 per-token distribution over experts used by the
            load-balancing losses: softmax of the logits for softmax routers, sigmoid scores
            normalised to sum 1 per token for sigmoid routers (Megatron-Core's
            ``compute_routing_scores_for_aux_loss``).
        num_experts: E.
        dropped: number of pairs the router selected but capacity dropped (0 when dropless).
        top_k: set when the pairs are token-major with exactly ``top_k`` per token (pair
            ``t·k + j`` belongs to token t), as dropless token choice produces; the dispatcher
            then combines with a batched matmul instead of a scatter. None otherwise.
    """

    token_idx: Tensor
    expert_idx: Tensor
    weight: Tensor
    logits: Tensor
    probs: Tensor
    num_experts: int
    dropped: int = 0
    top_k: int | None = None

    def __post_init__(self) -> None:
        n = self.token_idx.shape[0]
        if (
            self.token_idx.shape != (n,)
            or self.expert_idx.shape != (n,)
            or self.weight.shape != (n,)
        ):
            raise ValueError(
                "token_idx, expert_idx and weight must be 1-D of one length, got "
                f"{tuple(self.token_idx.shape)}, {tuple(self.expert_idx.shape)}, "
                f"{tuple(self.weight.shape)}"
            )
        if self.top_k is not None and n != self.logits.shape[0] * self.top_k:
            raise ValueError(
                f"top_k: {n} pairs are not {self.top_k} per token for T={self.logits.shape[0]}"
            )
        if self.logits.dim() != 2 or self.logits.shape[1] != self.num_experts:
            raise ValueError(
                f"logits must be [T, E={self.num_experts}], got {tuple(self.logits.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens routed (padding included)."""
        return self.logits.shape[0]

    @property
    def num_pairs(self) -> int:
        """N, the number of routed (token, expert) pairs."""
        return self.token_idx.shape[0]

    def counts(self, token_mask: Tensor | None = None) -> Tensor:
        """Pairs per expert, ``[E]`` int64; with ``token_mask`` ``[T]`` bool only valid tokens."""
        keep = None if token_mask is None else token_mask[self.token_idx]
        return expert_counts(self.expert_idx, self.num_experts, keep)


def check_expert_ids(ids: Tensor, num_experts: int, what: str) -> Tensor:
    """``ids`` as int64 after checking that every entry is an expert of ``[0, E)``.

    Used wherever expert indices come from outside a router (forced routing, router replay,
    hand-built plans): an index of -1 or E would otherwise fail deep inside a gather, or
    silently read another expert's row. Syncs with the device once (one ``min``/``max``).

    Raises:
        TypeError: ``ids`` is not an integer tensor (InvalidTypeError).
        ValueError: an entry outside ``[0, num_experts)`` (InvalidValueError, naming ``what``
            and the offending value).
    """
    if (
        not isinstance(ids, Tensor)
        or ids.is_floating_point()
        or ids.is_complex()
        or (ids.dtype == torch.bool)
    ):
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise InvalidTypeError(f"{what}: expected an integer tensor of expert ids, got {got}")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise InvalidValueError(
                f"{what}: expert id {bad} is outside [0, {num_experts}) (E = {num_experts})"
            )
    return ids.to(torch.int64)


def expert_counts(expert_idx: Tensor, num_experts: int, keep: Tensor | None = None) -> Tensor:
    """``[E]`` int64 number of entries of ``expert_idx`` ``[N]`` per expert (only where
    ``keep`` ``[N]`` bool is True).

    A scatter-add into E fixed slots rather than ``bincount``/boolean indexing, whose output
    shapes depend on the data: no host sync, and ``torch.compile`` traces it in one graph.
    """
    ones = torch.ones_like(expert_idx) if keep is None else keep.to(expert_idx.dtype)
    out = torch.zeros(num_experts, dtype=torch.int64, device=expert_idx.device)
    return out.scatter_add_(0, expert_idx, ones.to(torch.int64))
