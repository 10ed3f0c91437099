"""USMoE: unified sparse routing as a budgeted linear program.

Paper: Giang Do, Hung Le, Truyen Tran, "Rethinking Sparse Mixture of Experts from a Unified
Perspective" (USMoE; earlier "Unified Sparse Mixture of Experts"), ICML 2026, arXiv 2503.22996.
Authors' code: github.com/giangdip2410/USMoE (commit 70d6447), ``Training_Free/models/
modeling_{olmoe,qwen2_moe,deepseek}.py``.

What follows the paper / the authors' code exactly:

- Routing as an LP over the token × expert score table S with ``x ∈ [0, 1]``: maximise
  ``Σ S·x`` subject to a global pair budget ``Σ x = B`` only. Its optimum is the indicator of
  the top-B entries of the flattened table (:func:`solve_budgeted_assignment`); token choice
  (``≤ k`` per token) and expert choice (``≤ C`` per expert) are the same LP with an extra
  partition constraint, and greedy selection stays optimal there (the constraint sets are
  truncated partition matroids).
- The unified score of the released code: ``w = (1−r)·softmax_E(ℓ) + r·(2/E)·sigmoid(ℓ)``,
  ``r = 0.5`` (``usmoe_expert_score="sigmoid_scaled"``); the commented-out alternative
  replaces the second term by a softmax of ℓ over the sequence's tokens
  (``"softmax_over_tokens"``).
- Selection per sequence (the layer input's ``(B, S)``): the top-``S·k`` entries of the
  sequence's ``S × E`` table of w; a token gets 0..E experts, k on average.
- Combine weights: the code multiplies each selected expert's output by w itself
  (``usmoe_weight_norm="none"``); its OLMoE/Qwen blocks divide w by its sum over *all* experts
  when ``norm_topk_prob`` is set (``"all_experts"``). All three released backbones ship
  ``norm_topk_prob=False``, so ``"none"`` is the default. No renormalisation over the
  selected experts is done in the code.

This project's reading (not in the public code or text):

- ``budget_fraction``: a fractional budget ``round(f·k·T_group)`` (half up) per selection
  group, the paper's "flexible budget" (e.g. 0.86 for its 14% cost cut); met exactly.
- ``usmoe_weight_norm="selected"``: w divided by its sum over the token's selected experts, to
  swap USMoE into a model trained with normalised top-k weights (moelab's default) without a
  scale shift. The paper does not need it (its backbones are unnormalised).
- ``selection_scope="batch"`` (one group of all T tokens) and ``"causal_prefix"``: token t
  takes expert j iff its score is among the top ``round(f·k·(t+1))`` entries of the prefix
  table ``0..t`` — what sequence-scope USMoE would do if the sequence ended at t. Sequence and
  batch selection look at *future* tokens (as expert choice does), so a model routed that
  way cannot generate autoregressively; causal_prefix can, and its budget is met on average
  rather than exactly. With ``softmax_over_tokens`` the token softmax of prefix t runs over
  ``0..t``.
- Padding tokens (``token_mask`` False) are never selected and do not count in the budget.
- Training-based use: the code's from-scratch folder has no USMoE gate; moelab trains the same
  router end to end (gradients reach the router through w in the combine weights), with the
  load-balancing loss on ``softmax_E(ℓ)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan
from moelab.core.routers.base import Router


def budget_pairs(num_tokens: int, top_k: float, fraction: float) -> int:
    """``round(fraction · top_k · num_tokens)`` with halves rounded up (not banker's rounding)."""
    return math.floor(fraction * top_k * num_tokens + 0.5)


def solve_budgeted_assignment(
    scores: Tensor,
    budget: int | Tensor,
    per_token: int | None = None,
    per_expert: int | Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Optimal 0/1 solution of the routing LP with a pair budget.

    ``max Σ_te S_te·x_te  s.t.  Σ_te x_te = budget,  0 <= x <= 1``, optionally with
    ``Σ_e x_te <= per_token`` (token choice) or ``Σ_t x_te <= per_expert`` (expert choice).
    Each of these constraint sets is a (truncated) partition matroid, so the greedy solution
    — the top-``budget`` entries among each token's top-``per_token`` (or each expert's
    top-``per_expert``) — is an optimal vertex of the LP. Ties are broken by position
    (stable sort), deterministically.

    Args:
        scores: ``[T, E]`` or ``[G, T, E]`` float scores (G independent groups).
        budget: pairs to select per group: an int, or ``[G]`` int64.
        per_token: at most this many experts per token (token choice: k).
        per_expert: at most this many tokens per expert (expert choice: capacity); an int
            or ``[G]`` int64.
        valid: ``[T]`` / ``[G, T]`` bool; invalid (padding) tokens are never selected.
    Returns:
        bool mask of ``scores``' shape with exactly ``budget`` True entries per group.
    Raises:
        ValueError: both caps given (a b-matching, not a matroid: not supported), or a budget
            larger than the entries the caps allow.
    """
    if per_token is not None and per_expert is not None:
        raise ValueError(
            "per_token, per_expert: give at most one (both at once is a b-matching problem, "
            "which greedy selection does not solve)"
        )
    squeeze = scores.dim() == 2
    S = scores.unsqueeze(0) if squeeze else scores
    if S.dim() != 3:
        raise ValueError(f"scores: expected [T, E] or [G, T, E], got {tuple(scores.shape)}")
    G, T, E = S.shape
    dev = S.device
    allowed = torch.ones(G, T, E, dtype=torch.bool, device=dev)
    if valid is not None:
        allowed &= (valid.unsqueeze(0) if squeeze else valid).unsqueeze(-1)
    neg = torch.finfo(S.dtype).min
    masked = S.masked_fill(~allowed, neg)
    if per_token is not None and per_token < E:
        idx = masked.topk(per_token, dim=-1).indices
        cap = torch.zeros_like(allowed).scatter_(-1, idx, True)
        allowed &= cap
    if per_expert is not None:
        c = torch.as_tensor(per_expert, device=dev).reshape(-1).expand(G).clamp(0, T)
        order = masked.argsort(dim=1, descending=True, stable=True)  # [G, T, E]
        rank_ok = (torch.arange(T, device=dev).view(1, T, 1) < c.view(G, 1, 1)).expand(G, T, E)
        cap = torch.zeros_like(allowed).scatter_(1, order, rank_ok)
        allowed &= cap
    n = torch.as_tensor(budget, device=dev).reshape(-1).expand(G)
    available = allowed.view(G, -1).sum(-1)
    if bool((n > available).any()) or bool((n < 0).any()):
        raise ValueError(
            f"budget: {n.tolist()} pairs requested but only {available.tolist()} allowed "
            "by the caps and valid tokens"
        )
    flat = S.masked_fill(~allowed, float("-inf")).reshape(G, T * E)
    order = flat.argsort(dim=-1, descending=True, stable=True)
    keep = torch.arange(T * E, device=dev).unsqueeze(0) < n.unsqueeze(1)
    mask = torch.zeros(G, T * E, dtype=torch.bool, device=dev).scatter_(1, order, keep)
    mask = mask.view(G, T, E)
    return mask[0] if squeeze else mask


def unified_scores(
    logits_GSE: Tensor,
    rate: float,
    expert_score: str = "sigmoid_scaled",
    valid_GS: Tensor | None = None,
) -> Tensor:
    """USMoE's unified score ``w = (1−r)·softmax_E(ℓ) + r·f_alt(ℓ)``, ``[G, S, E]`` float32.

    ``f_alt = (2/E)·sigmoid(ℓ)`` (``"sigmoid_scaled"``, the released code) or the softmax of
    ℓ over the group's S tokens for each expert (``"softmax_over_tokens"``, the code's
    commented-out line; padding excluded from that softmax).
    """
    E = logits_GSE.shape[-1]
    w_tok = logits_GSE.softmax(dim=-1)
    if rate == 0.0:
        return w_tok
    if expert_score == "sigmoid_scaled":
        alt = logits_GSE.sigmoid() * (2.0 / E)
    else:
        z = logits_GSE
        if valid_GS is not None:
            z = z.masked_fill(~valid_GS.unsqueeze(-1), float("-inf"))
        alt = z.softmax(dim=1).nan_to_num(0.0)
    return (1.0 - rate) * w_tok + rate * alt


class USMoERouter(Router):
    """USMoE routing (arXiv 2503.22996): top-B (token, expert) pairs of each selection group.

    Needs the layer input's leading shape: :class:`moelab.core.layer.MoELayer` passes
    ``batch_shape`` (and the padding mask) to routers whose ``uses_batch_shape`` is True. A
    flat ``[T, D]`` input is one sequence.
    """

    uses_batch_shape = True

    def forward(
        self,
        x_TD: Tensor,
        batch_shape: tuple[int, ...] | None = None,
        token_mask: Tensor | None = None,
    ) -> RoutingPlan:
        return self.plan(self.logits(x_TD), batch_shape, token_mask)

    def _groups(self, T: int, batch_shape: tuple[int, ...] | None) -> tuple[int, int]:
        scope = self.config.selection_scope
        if scope == "batch" or batch_shape is None or len(batch_shape) < 2:
            return 1, T
        S = batch_shape[-1]
        return T // S, S

    def plan(
        self,
        logits: Tensor,
        batch_shape: tuple[int, ...] | None = None,
        token_mask: Tensor | None = None,
    ) -> RoutingPlan:
        """Route ``logits`` ``[T, E]`` float32; pairs come out token-major."""
        cfg = self.config
        T, E = logits.shape
        G, S = self._groups(T, batch_shape)
        valid = (
            token_mask.reshape(G, S)
            if token_mask is not None
            else torch.ones(G, S, dtype=torch.bool, device=logits.device)
        )
        lg = logits.reshape(G, S, E)
        if cfg.selection_scope == "causal_prefix":
            mask, w = self._causal_prefix(lg, valid)
        else:
            w = unified_scores(lg, cfg.usmoe_rate, cfg.usmoe_expert_score, valid)
            n = torch.tensor(
                [budget_pairs(int(v), cfg.top_k, cfg.budget_fraction) for v in valid.sum(1)],
                device=logits.device,
            )
            per_token = cfg.top_k if cfg.usmoe_constraint == "per_token" else None
            per_expert = (n + E - 1) // E if cfg.usmoe_constraint == "per_expert" else None
            with torch.no_grad():
                mask = solve_budgeted_assignment(w.detach(), n, per_token, per_expert, valid)
        mask, w = mask.reshape(T, E), w.reshape(T, E)
        token_idx, expert_idx = mask.nonzero(as_tuple=True)
        weight = w[token_idx, expert_idx]
        if cfg.usmoe_weight_norm == "all_experts":
            weight = weight / w.sum(-1).clamp_min(1e-20)[token_idx]
        elif cfg.usmoe_weight_norm == "selected":
            denom = torch.zeros(T, dtype=w.dtype, device=w.device).index_add(0, token_idx, weight)
            weight = weight / denom.clamp_min(1e-20)[token_idx]
        if cfg.routed_scaling_factor != 1.0:
            weight = weight * cfg.routed_scaling_factor
        return RoutingPlan(
            token_idx=token_idx,
            expert_idx=expert_idx,
            weight=weight,
            logits=logits,
            probs=logits.softmax(dim=-1),
            num_experts=E,
        )

    def _causal_prefix(self, lg: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Token t's experts: its entries among the top ``round(f·k·n_t)`` of the prefix
        table ``0..t`` (n_t valid tokens in the prefix). Returns (mask, weights) ``[G, S, E]``."""
        cfg = self.config
        G, S, E = lg.shape
        r = cfg.usmoe_rate
        w_tok = lg.softmax(dim=-1)
        if r > 0 and cfg.usmoe_expert_score == "softmax_over_tokens":
            z = lg.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            lse = torch.logcumsumexp(z, dim=1)  # [G, S(t), E]: prefix normaliser
            # w^(t)[s, e] for s <= t: [G, S(t), S(s), E]
            alt = (z.unsqueeze(1) - lse.unsqueeze(2)).exp().nan_to_num(0.0)
            table = (1 - r) * w_tok.unsqueeze(1) + r * alt
        else:
            w = unified_scores(lg, r, cfg.usmoe_expert_score)
            table = w.unsqueeze(1).expand(G, S, S, E)
        ar = torch.arange(S, device=lg.device)
        future = ar.view(1, S, 1) < ar.view(1, 1, S)  # s > t
        usable = ~future & valid.unsqueeze(1)  # [G, S(t), S(s)]
        flat = table.detach().masked_fill(~usable.unsqueeze(-1), float("-inf")).reshape(G, S, -1)
        n_t = valid.long().cumsum(1)
        budget = torch.floor(cfg.budget_fraction * cfg.top_k * n_t.double() + 0.5).long()
        budget = budget.clamp(min=1).clamp(max=n_t * E)
        ranked = flat.sort(dim=-1, descending=True).values
        thresh = ranked.gather(-1, (budget - 1).clamp(min=0).unsqueeze(-1))  # [G, S, 1]
        w_own = table[:, ar, ar]  # [G, S(t), E]: token t's row of its own prefix table
        mask = (w_own.detach() >= thresh) & valid.unsqueeze(-1) & (n_t > 0).unsqueeze(-1)
        return mask, w_own
