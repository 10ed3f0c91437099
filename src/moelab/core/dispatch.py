"""Local (single-process) token dispatch: permute rows by expert, run experts, combine.

Pairs are sorted stably by expert (torchtitan ``_local_reorder``, Megatron ``permute``), the
token rows gathered into contiguous per-expert blocks, and the expert outputs combined with
their weights in float32. The input is never written to.

Two combine paths, both deterministic:
- uniform plans (``RoutingPlan.top_k`` set: k pairs per token, token-major): the expert
  outputs are permuted back to pair order and each token's k rows are reduced with one batched
  matmul ``w[T,1,k] @ y[T,k,D]``; the gather and the permutation have gather-only backwards
  (no scatter-add), so forward and backward are free of atomics on every device;
- general plans (capacity dropping, expert choice, variable budgets): ``index_add`` on CPU
  (sequential), and on accelerators a sort by token plus ``segment_reduce``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.autocast import autocast_off
from moelab.core.plan import RoutingPlan, expert_counts


class _GatherTokens(torch.autograd.Function):
    """``x[token_of_row]`` for a uniform plan; backward = gather back to pair order and sum the
    k rows of each token (instead of autograd's scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, token_of_row: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.shape = (x.shape[0], k, x.shape[1])
        return x[token_of_row]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse).view(ctx.shape).sum(1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``y[perm]`` for a permutation; backward = gather with the inverse permutation."""

    @staticmethod
    def forward(ctx, y: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return y.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass(frozen=True)
class Dispatched:
    """Rows handed to the experts.

    Attributes:
        x: ``[N, D]`` rows sorted by expert (None when dispatched with ``gather=False``).
        counts: ``[E]`` int64 rows per expert.
        token_idx: ``[N]`` token of every sorted row.
        weight: ``[N]`` float32 combine weight of every sorted row.
        order: ``[N]`` pair index of every sorted row (sorted = pairs[order]).
        inverse: ``[N]`` inverse of ``order``, set for uniform plans.
        top_k: the plan's ``top_k`` (uniform plans) or None.
        pair_weight: ``[N]`` combine weights in pair order (uniform plans).
    """

    x: Tensor | None
    counts: Tensor
    token_idx: Tensor
    weight: Tensor | None
    order: Tensor
    inverse: Tensor | None = None
    top_k: int | None = None
    pair_weight: Tensor | None = None


class LocalDispatcher:
    """Sort-by-expert dispatch on one device.

    Args:
        deterministic: for general plans on accelerators, combine with a sort by token and
            ``segment_reduce`` instead of ``index_add`` (atomic adds). CPU and uniform plans
            are always deterministic.
    """

    def __init__(self, deterministic: bool = True) -> None:
        self.deterministic = deterministic

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan, gather: bool = True) -> Dispatched:
        """Sort ``plan``'s pairs by expert; ``gather=False`` (uniform plans only) skips
        gathering the rows, for experts that read ``x_TD[token_idx]`` themselves."""
        if plan.top_k is not None:
            return dispatch_uniform(
                x_TD, plan.expert_idx, plan.weight, plan.num_experts, plan.top_k, gather
            )
        if not gather:
            raise ValueError("gather=False needs a uniform plan (plan.top_k set)")
        order = torch.argsort(plan.expert_idx, stable=True)
        counts = expert_counts(plan.expert_idx, plan.num_experts)
        token_idx = plan.token_idx[order]
        return Dispatched(
            x=x_TD[token_idx],
            counts=counts,
            token_idx=token_idx,
            weight=plan.weight[order],
            order=order,
        )

    def combine(self, y_ND: Tensor, d: Dispatched, num_tokens: int) -> Tensor:
        """``out[t] = Σ_{pairs of t} w · y``, summed in float32 (float64 for float64 inputs).

        Returns ``[T, D]`` in the weights' dtype.
        """
        if d.top_k is not None:
            w = d.pair_weight
            y_pairs = _PermuteRows.apply(y_ND, d.inverse, d.order).to(w.dtype)
            k = d.top_k
            D = y_ND.shape[-1]
            with autocast_off(w.device):  # the sum stays in float32 under mixed precision
                out = torch.bmm(w.view(num_tokens, 1, k), y_pairs.view(num_tokens, k, D))
            return out.squeeze(1)
        y = y_ND.to(d.weight.dtype) * d.weight.unsqueeze(-1)
        if y.device.type == "cpu" or not self.deterministic:
            out = y.new_zeros(num_tokens, y.shape[-1])
            return out.index_add(0, d.token_idx, y)
        return segment_combine(y, d.token_idx, num_tokens)


def permute_rows(y: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
    """``y[perm]`` for a permutation ``perm`` with inverse ``inverse`` (both ``[N]`` int64);
    the backward is a gather with ``inverse`` (no scatter-add)."""
    return _PermuteRows.apply(y, perm, inverse)


def dispatch_uniform(
    x_TD: Tensor,
    expert_idx: Tensor,
    weight: Tensor,
    num_experts: int,
    k: int,
    gather: bool = True,
) -> Dispatched:
    """Sort the pairs of a uniform (k per token, token-major) routing by expert.

    Args:
        x_TD: ``[T, D]`` rows; pair ``t·k + j`` belongs to row t.
        expert_idx: ``[T·k]`` int64 in ``[0, num_experts)``.
        weight: ``[T·k]`` float32 combine weights (pair order).
        gather: False leaves ``Dispatched.x`` None (the fused CPU experts gather themselves).
    Returns:
        :class:`Dispatched` for :meth:`LocalDispatcher.combine` (gather-only backwards).
    """
    order = torch.argsort(expert_idx, stable=True)
    counts = expert_counts(expert_idx, num_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    token_idx = torch.div(order, k, rounding_mode="floor")
    return Dispatched(
        x=_GatherTokens.apply(x_TD, token_idx, inverse, k) if gather else None,
        counts=counts,
        token_idx=token_idx,
        weight=None,
        order=order,
        inverse=inverse,
        top_k=k,
        pair_weight=weight,
    )


def segment_combine(y_ND: Tensor, token_idx: Tensor, num_tokens: int) -> Tensor:
    """Deterministic ``out[t] = Σ_{i: token_idx[i]=t} y[i]``: sort rows by token (stable) and
    sum each token's contiguous segment. ``[N, D]`` → ``[T, D]``."""
    by_token = torch.argsort(token_idx, stable=True)
    lengths = torch.bincount(token_idx, minlength=num_tokens)
    return torch.segment_reduce(y_ND[by_token], "sum", lengths=lengths, unsafe=True)
