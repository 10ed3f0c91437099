"""All-to-all expert-parallel dispatcher (GShard / DeepSpeed-MoE / Megatron-Core
``MoEAlltoAllTokenDispatcher``, torchtitan's EP), on the MoELayer's dispatcher seam.

The E experts are sharded over the EP group: rank e of the group holds experts
``[e·E/EP, (e+1)·E/EP)`` as an :class:`~moelab.core.experts.ExpertBank` of E/EP experts.
One layer call:

1. local sort of this rank's pairs by global expert (the :class:`LocalDispatcher`'s, so
   the combine weights and the gather-only backwards are shared with single-process runs);
2. count exchange: ``all_to_all_single`` of the ``[E]`` per-expert counts, so each rank knows
   how many rows it receives from every peer for each of its experts (the metadata);
3. ``all_to_all_single`` of the sorted rows (rows for experts of rank s go to rank s);
4. the received rows, grouped by source rank, are permuted so they are contiguous per local
   expert (torchtitan ``_permute``), and the local experts run on them;
5. reverse permutation and the reverse all-to-all bring every row's output home;
6. the local combine (float32, deterministic) weights and sums each token's k outputs.

Pairs whose expert lives on another rank never touch this rank's experts: they leave in
step 3 and return in step 5. Backward is the same exchange reversed (autograd of
:func:`moelab.parallel.comm.all_to_all`).

Choices: counts are exchanged as int64; the rows travel in the activation dtype; bytes sent
are counted in :attr:`AllToAllDispatcher.stats` (forward only, self-sends excluded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moelab.core.dispatch import Dispatched, LocalDispatcher, permute_rows
from moelab.core.plan import RoutingPlan
from moelab.errors import InvalidValueError
from moelab.parallel.comm import CommStats, all_to_all, sent_bytes


@dataclass(frozen=True)
class EPDispatched:
    """What :meth:`AllToAllDispatcher.dispatch` hands the local experts.

    Attributes:
        x: ``[R, D]`` received rows, contiguous per local expert.
        counts: ``[E_local]`` int64 rows per local expert.
        token_idx: None (rows are other ranks' tokens; the specialization loss is refused).
        local: the local sort of this rank's own pairs (for the combine).
        perm, inverse: ``[R]`` received order → expert order, and back.
        send_splits, recv_splits: rows sent to / received from each EP rank.
    """

    x: Tensor
    counts: Tensor
    token_idx: None
    local: Dispatched
    perm: Tensor
    inverse: Tensor
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher:
    """Expert-parallel dispatch over ``group`` (EP ranks), experts sharded by rank.

    Args:
        group: the EP process group (``ParallelGroups.ep_group``).
        num_experts: E, global experts (divisible by the group size).
    Raises:
        ValueError: E is not divisible by the EP size.
    """

    def __init__(self, group, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise InvalidValueError(
                f"--expert-parallel: {self.ep} does not divide the number of experts {num_experts}"
            )
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep
        self.local = LocalDispatcher()
        self.stats = CommStats()

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> EPDispatched:
        if plan.num_experts != self.num_experts:
            raise InvalidValueError(
                f"plan: routes to {plan.num_experts} experts, the dispatcher shards {self.num_experts}"
            )
        d = self.local.dispatch(x_TD, plan)
        ep, E_l = self.ep, self.num_local
        counts_E = d.counts.to(torch.int64)
        recv_counts = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts, counts_E, group=self.group)
        recv = recv_counts.view(ep, E_l)  # [source rank, local expert]
        send_splits = counts_E.view(ep, E_l).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        x_recv = all_to_all(d.x, recv_splits, send_splits, self.group)
        expert_of_row = torch.repeat_interleave(
            torch.arange(E_l, device=x_recv.device).repeat(ep), recv.reshape(-1)
        )
        perm = torch.argsort(expert_of_row, stable=True)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
        row_bytes = x_TD.shape[-1] * x_TD.element_size()
        meta = sent_bytes([E_l] * ep, counts_E.element_size(), self.rank)
        payload = sent_bytes(send_splits, row_bytes, self.rank)
        self.stats.add(payload, meta)
        return EPDispatched(
            x=permute_rows(x_recv, perm, inverse),
            counts=recv.sum(0),
            token_idx=None,
            local=d,
            perm=perm,
            inverse=inverse,
            send_splits=send_splits,
            recv_splits=recv_splits,
        )

    def combine(self, y_RD: Tensor, d: EPDispatched, num_tokens: int) -> Tensor:
        """Send the experts' outputs home and combine them: ``[R, D]`` → ``[T, D]`` float32."""
        y_recv = permute_rows(y_RD, d.inverse, d.perm)
        y_home = all_to_all(y_recv, d.send_splits, d.recv_splits, self.group)
        row_bytes = y_RD.shape[-1] * y_RD.element_size()
        self.stats.add(sent_bytes(d.recv_splits, row_bytes, self.rank), new_call=False)
        return self.local.combine(y_home, d.local, num_tokens)
