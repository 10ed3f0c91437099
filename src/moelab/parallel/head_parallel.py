"""Head Parallel dispatcher for Multi-Head LatentMoE (Cui et al., ICML 2026, arXiv 2602.04870).

The H heads are sharded over the HP group of W ranks: rank r owns heads
``[r·H/W, (r+1)·H/W)`` (their routers, biases and experts). Each layer call makes two
all-to-alls with fixed, equal split sizes and no metadata:

1. ``scatter``: every rank sends the sub-tokens of the heads owned by rank s, ``[T, H/W, d_h]``,
   to rank s and receives its own heads' sub-tokens of all W ranks, ``[W·T, H/W, d_h]``;
2. the owner routes and computes its heads locally (no routing-dependent traffic);
3. ``gather``: the reverse exchange returns ``[T, H, d_h]`` to every rank.

Bytes sent per rank per layer forward: ``2·T·H·d_h·(W−1)/W`` elements, independent of k and of
the routing, and equal on all ranks (counted in :attr:`HeadParallelDispatcher.stats`).

Requirement (the price of having no metadata): every rank of the group passes the same T.
Choice: the bias counts of an owned head are summed over the DP group (the replicas of the same
heads, which see other tokens) so replicas stay identical; with DP = 1 they are the owner's
own counts, as in the authors' code ("not averaged across ranks").
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.parallel.comm import CommStats, all_to_all, sent_bytes


class HeadParallelDispatcher:
    """Fixed equal-split head exchange over ``group``.

    Args:
        group: the HP process group (the EP group of :class:`ParallelGroups`).
        num_heads: H (divisible by the group size).
        dp_group: the group of ranks holding the same heads (bias counts), or None.
    Raises:
        ValueError: H is not divisible by the group size.
    """

    def __init__(self, group, num_heads: int, dp_group=None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_heads % self.world:
            raise InvalidValueError(
                f"--expert-parallel: {self.world} ranks do not divide the {num_heads} heads "
                "of the Multi-Head LatentMoE layers"
            )
        self.num_heads = num_heads
        self.local_heads = num_heads // self.world
        self.head_offset = self.rank * self.local_heads
        self.dp_group = dp_group
        self.stats = CommStats()

    def scatter(self, s_THd: Tensor) -> Tensor:
        """``[T, H, d_h]`` (all heads of my tokens) → ``[W·T, H/W, d_h]`` (my heads of every
        rank's tokens, grouped by source rank)."""
        T, _, dh = s_THd.shape
        W, Hl = self.world, self.local_heads
        send = s_THd.view(T, W, Hl * dh).transpose(0, 1).reshape(W * T, Hl * dh)
        recv = all_to_all(send, [T] * W, [T] * W, self.group)
        self._count(send, T, new_call=True)
        return recv.view(W * T, Hl, dh)

    def gather(self, y_SHd: Tensor) -> Tensor:
        """Inverse of :meth:`scatter`: ``[W·T, H/W, d_h]`` → ``[T, H, d_h]``."""
        S, Hl, dh = y_SHd.shape
        W = self.world
        T = S // W
        back = all_to_all(y_SHd.reshape(S, Hl * dh), [T] * W, [T] * W, self.group)
        self._count(back, T, new_call=False)
        return back.view(W, T, Hl * dh).transpose(0, 1).reshape(T, W * Hl, dh)

    def bias_group(self):
        return self.dp_group

    def _count(self, rows: Tensor, T: int, new_call: bool) -> None:
        row_bytes = rows.shape[-1] * rows.element_size()
        self.stats.add(sent_bytes([T] * self.world, row_bytes, self.rank), new_call=new_call)
