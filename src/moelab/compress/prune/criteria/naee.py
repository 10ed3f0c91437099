"""NAEE-style enumeration: keep the expert subset that best reconstructs the layer's output.

Lu et al., "Not All Experts are Equal: Efficient Expert Pruning and Skipping for
Mixture-of-Experts Large Language Models", ACL 2024, arXiv 2402.14800; code
Lucky-Lance/Expert_Sparsity (``model/wrapper.py`` ``enumerate``/``prune``,
``method/expert_pruning.py`` ``layerwise_pruning``).

As the authors' code does [C]: one pass over the *unpruned* model (``layerwise_pruning``); for
every subset of experts to drop (``itertools.combinations(range(E), E − n)`` order), the
dropped experts' router logits are set to −∞ and the layer re-routes (same softmax, top-k,
renormalisation; with an aux-loss-free selection bias the dropped experts' bias is −∞ too, as
the pruned layer has none for them); the loss is ``Σ over calibration batches of ‖Z − Z′‖_F`` with Z the
unpruned layer's routed output on that batch; the first subset with the smallest loss is
dropped.

Our implementation of it [I]: instead of caching the batches' inputs and outputs (memory that
grows with calibration tokens) and re-running the layer C(E, n) times, each batch is processed
once: every expert's output on every token is computed once (``F [E, T, D]``), and per token
the Gram matrix ``G_t = F_t F_tᵀ``, ``c_t = F_t Z_t`` and ``‖Z_t‖²`` give
``‖Z_t − Z′_t‖² = ‖Z_t‖² − 2 Σ_j w_j c_t[e_j] + Σ_{j,l} w_j w_l G_t[e_j, e_l]`` for any
subset's routing (e_j, w_j) in O(k²); the re-routing itself runs the layer's own router on the
masked logits. Everything is float64 (the authors accumulate the norm in float64 too). The
shared expert cancels in ``Z − Z′``. Feasible for E ≤ 16 (C(16, 8) = 12 870 subsets);
capacity-limited routers are refused (their capacity depends on the batch, which the
vectorised re-routing changes).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor

from moelab.compress.prune.criteria.base import Criterion, Selection
from moelab.core.layer import MoELayer, MoEOutput
from moelab.errors import InvalidValueError

MAX_EXPERTS = 16
_ROWS_PER_CHUNK = 1 << 17


def check_naee_layer(layer: MoELayer, where: str) -> None:
    """Raise ValueError unless NAEE can enumerate ``layer``: at most :data:`MAX_EXPERTS`
    experts, and dropless (re-routing with masked logits is the pruned layer only without a
    capacity; see :mod:`moelab.compress.prune.apply`)."""
    E = layer.experts.num_experts
    if E > MAX_EXPERTS:
        raise InvalidValueError(
            f"naee: enumeration needs E <= {MAX_EXPERTS} experts per layer, {where} has {E}"
        )
    if layer.config.router.capacity_factor is not None:
        raise InvalidValueError(
            f"naee: needs a dropless router (capacity_factor=None); {where} has "
            f"capacity_factor={layer.config.router.capacity_factor}"
        )


class SubsetErrors:
    """Streaming ``Σ_batches ‖Z − Z′_S‖_F`` for every subset S of ``n_keep`` experts.

    Attributes:
        dropped: the candidate dropped-expert tuples, in ``itertools.combinations`` order.
        loss: ``[len(dropped)]`` float64 accumulated loss.
    """

    def __init__(self, layer: MoELayer, n_keep: int) -> None:
        check_naee_layer(layer, "layer")
        E = layer.experts.num_experts
        if not 1 <= n_keep <= E:
            raise InvalidValueError(f"n_keep: must be in [1, {E}], got {n_keep}")
        self.num_experts, self.n_keep = E, n_keep
        self.dropped = list(itertools.combinations(range(E), E - n_keep))
        mask = torch.zeros(len(self.dropped), E, dtype=torch.bool)
        for i, d in enumerate(self.dropped):
            mask[i, list(d)] = True
        self.mask = mask
        self.loss = torch.zeros(len(self.dropped), dtype=torch.float64)

    @torch.no_grad()
    def update(self, layer: MoELayer, x: Tensor, out: MoEOutput) -> None:
        x_TD = x.reshape(-1, x.shape[-1])
        T, E = x_TD.shape[0], self.num_experts
        w_dtype = layer.experts.w_down.dtype
        rows = x_TD.to(w_dtype).repeat(E, 1)
        counts = torch.full((E,), T, dtype=torch.int64, device=x_TD.device)
        F_ETD = layer.experts(rows, counts).to(torch.float64).view(E, T, -1)
        p = out.plan
        Z = torch.zeros(T, F_ETD.shape[-1], dtype=torch.float64, device=x_TD.device)
        Z.index_add_(0, p.token_idx, p.weight.double()[:, None] * F_ETD[p.expert_idx, p.token_idx])
        F_TED = F_ETD.transpose(0, 1)
        G = F_TED @ F_TED.transpose(1, 2)  # [T, E, E]
        c = (F_TED @ Z[:, :, None]).squeeze(-1)  # [T, E]
        z2 = (Z * Z).sum(-1)  # [T]
        logits = layer.router.logits(x_TD)
        mask = self.mask.to(x_TD.device)
        chunk = max(1, _ROWS_PER_CHUNK // max(T, 1))
        t = torch.arange(T, device=x_TD.device)
        router = layer.router
        bias = getattr(router, "expert_bias", None)
        if bias is not None:
            chunk = 1  # the selection bias is per call: mask it one subset at a time
        for s in range(0, mask.shape[0], chunk):
            m = mask[s : s + chunk]
            C = m.shape[0]
            masked = logits.unsqueeze(0).masked_fill(m[:, None, :], float("-inf"))
            if bias is not None:
                router.expert_bias = bias.masked_fill(m[0], float("-inf"))
            try:
                plan = router.plan(masked.reshape(C * T, E))
            finally:
                if bias is not None:
                    router.expert_bias = bias
            k = plan.top_k
            idx = plan.expert_idx.view(C, T, k)
            w = plan.weight.double().view(C, T, k)
            cg = c[t[None, :, None], idx]  # [C, T, k]
            Gg = G[t[None, :, None, None], idx[..., :, None], idx[..., None, :]]  # [C,T,k,k]
            err = z2[None] - 2 * (w * cg).sum(-1) + torch.einsum("ctj,ctjl,ctl->ct", w, Gg, w)
            self.loss[s : s + C] += err.sum(1).clamp_min(0).sqrt().cpu()


class NAEE(Criterion):
    """Enumerate every subset of ``n_keep`` experts; keep the best reconstructing one."""

    name = "naee"
    sequential = False

    def check_layer(self, layer: MoELayer, where: str) -> None:
        check_naee_layer(layer, where)

    def accumulator(self, layer: MoELayer, n_keep: int) -> SubsetErrors:
        return SubsetErrors(layer, n_keep)

    def select(self, acc: SubsetErrors, n_keep: int) -> Selection:
        best = int(torch.argmin(acc.loss))  # first minimum, as min() over the authors' dict
        drop = set(acc.dropped[best])
        keep = [e for e in range(acc.num_experts) if e not in drop]
        # per-expert report: the best loss among the subsets that keep the expert (lower =
        # better), negated so that higher is better like the other criteria's scores
        per_expert = []
        for e in range(acc.num_experts):
            ok = ~acc.mask[:, e]
            per_expert.append(-float(acc.loss[ok].min()) if ok.any() else -math.inf)
        return Selection(keep=keep, scores=per_expert)

    def options(self) -> dict[str, Any]:
        return {"subsets": "all"}
