"""USMoE: unified sparse routing as a budgeted linear program.

Paper: Giang Do, Hung Le, Truyen Tran, "Rethinking Sparse Mixture of Experts from a Unified
Perspective" (USMoE; earlier "Unified Sparse Mixture of Experts"), ICML 2026, arXiv 2503.22996.
Authors' code: github.com/giangdip2410/USMoE (commit 70d6447): ``Training_Free/models/
modeling_{olmoe,qwen2_moe,deepseek}.py`` (training-free) and ``Training_scratch/
custom_transformer.py`` ``FMoETransformerMLP`` (training-based: every MoE FFN of its
``mem_transformer.py`` Transformer-XL).

What follows the paper / the authors' code exactly:

- Routing as an LP over the token × expert score table S with ``x ∈ [0, 1]``: maximise
  ``Σ S·x`` subject to a global pair budget ``Σ x = B`` only. Its optimum is the indicator of
  the top-B entries of the flattened table (:func:`solve_budgeted_assignment`); token choice
  (``≤ k`` per token) and expert choice (``≤ C`` per expert) are the same LP with an extra
  partition constraint, and greedy selection stays optimal there (the constraint sets are
  truncated partition matroids).
- The unified score ``w = (1−r)·softmax_E(ℓ) + r·f_alt(ℓ)``, ``r = 0.5``, with f_alt named by
  its source (``usmoe_expert_score``): ``"sigmoid_scaled"`` = ``(2/E)·sigmoid(ℓ)`` (the
  released code); ``"softmax_over_tokens"`` = the code's commented-out line in
  ``modeling_deepseek.py``: softmax of ℓ over the group's tokens for each expert, then each
  token's row divided by its sum over experts (so both terms lie on a per-token simplex);
  ``"paper_expert_choice"`` = the paper's expert-dimension (EC-style) score f_e as a secondary
  summary gives it (``f = α·f_e + β·f_t``): the softmax over tokens without the row
  renormalisation (moelab's earlier ``softmax_over_tokens``).
- Selection groups (``selection_scope``): ``"position"`` — one time position across the batch
  (budget ``B·k``), which is what ``FMoETransformerMLP`` does on Transformer-XL's
  ``[time, batch, D]`` tensors, and causal in time; ``"sequence"`` — each sequence's
  ``S × E`` table (the training-free code's ``(batch, S·E)`` reshape). A token gets 0..E
  experts, k on average.
- Combine weights: the code multiplies each selected expert's output by w itself
  (``usmoe_weight_norm="none"``); its OLMoE/Qwen blocks divide w by its sum over *all* experts
  when ``norm_topk_prob`` is set (``"all_experts"``). All three released backbones ship
  ``norm_topk_prob=False``, so ``"none"`` is the default.
- Training-based USMoE as released trains the router end to end through w with **no
  load-balancing loss**: ``--gate_name`` is swallowed by ``**kwargs`` in
  ``FMoETransformerMLP``, so the configured balancing gate never exists and ``train.py`` adds
  ``0.01·0``. ``moelab train --router usmoe`` therefore defaults to ``--aux-loss none``.

This project's reading (not in the public code or text):

- ``budget_fraction``: a fractional budget ``round(f·k·T_group)`` (half up) per selection
  group, the paper's "flexible budget" (e.g. 0.86 for its 14% cost cut); met exactly.
- ``usmoe_weight_norm="selected"``: w divided by its sum over the token's selected experts, to
  swap USMoE into a model trained with normalised top-k weights without a scale shift
  (``"auto"``, the default, is ``"none"`` except that :func:`moelab.models.with_router` picks
  ``"selected"`` for such models).
- ``selection_scope="batch"`` (one group of all T tokens) and ``"causal_prefix"``: token t
  takes expert j iff its score is among the top ``round(f·k·n_t)`` entries of the prefix
  table ``0..t`` (n_t valid tokens) — what sequence-scope USMoE would do if the sequence ended
  at t; its budget is met on average rather than exactly. With a token-softmax f_alt the
  prefix table uses the prefix's own normaliser. Memory is linear in S; decoding carries the
  prefix's logits in a :class:`PrefixState` (incremental == full recomputation).
  ``"sequence"`` and ``"batch"`` look at *future* tokens (as expert choice does): not a causal
  LM; ``moelab train``/``eval`` refuse them without ``--allow-noncausal-routing``.
- Padding tokens (``token_mask`` False) are never selected and do not count in the budget
  (the code ranks padding too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


EXPERT_SCORES = ("sigmoid_scaled", "softmax_over_tokens", "paper_expert_choice")
TOKEN_SOFTMAX_SCORES = ("softmax_over_tokens", "paper_expert_choice")


def _token_softmax_term(z_GSE: Tensor, lse_GE: Tensor, expert_score: str) -> Tensor:
    """``exp(z − lse)`` (softmax over tokens given the group normaliser ``lse``), with each
    token's row renormalised over experts for ``"softmax_over_tokens"``. Padding rows
    (``z = −inf``) give 0."""
    alt = (z_GSE - lse_GE).exp().nan_to_num(0.0)
    if expert_score == "softmax_over_tokens":
        alt = alt / alt.sum(-1, keepdim=True).clamp_min(torch.finfo(alt.dtype).tiny)
    return alt


def unified_scores(
    logits_GSE: Tensor,
    rate: float,
    expert_score: str = "sigmoid_scaled",
    valid_GS: Tensor | None = None,
) -> Tensor:
    """USMoE's unified score ``w = (1−r)·softmax_E(ℓ) + r·f_alt(ℓ)``, ``[G, S, E]`` float32.

    ``f_alt`` by ``expert_score`` (see the module docstring for the source of each):
    ``"sigmoid_scaled"`` = ``(2/E)·sigmoid(ℓ)``; ``"softmax_over_tokens"`` = softmax over the
    group's S tokens, each token's row then renormalised over experts;
    ``"paper_expert_choice"`` = the softmax over tokens alone. Padding (``valid_GS`` False) is
    excluded from the token softmax.

    Raises:
        ValueError: unknown ``expert_score``.
    """
    if expert_score not in EXPERT_SCORES:
        raise ValueError(f"expert_score: must be one of {EXPERT_SCORES}, got {expert_score!r}")
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
        alt = _token_softmax_term(z, z.logsumexp(dim=1, keepdim=True), expert_score)
    return (1.0 - rate) * w_tok + rate * alt


@dataclass
class PrefixState:
    """What ``causal_prefix`` routing of later tokens needs from earlier ones.

    Attributes:
        logits: ``[G, n, E]`` float32 router logits of the n positions seen so far.
        valid: ``[G, n]`` bool, real (non-padding) positions.
    """

    logits: Tensor
    valid: Tensor

    @property
    def length(self) -> int:
        return self.logits.shape[1]

    def truncate(self, n: int) -> None:
        """Forget positions ``n..`` (a KV cache rewound to ``start_pos = n``)."""
        self.logits, self.valid = self.logits[:, :n], self.valid[:, :n]


class USMoERouter(Router):
    """USMoE routing (arXiv 2503.22996): top-B (token, expert) pairs of each selection group.

    Needs the layer input's leading shape: :class:`moelab.core.layer.MoELayer` passes
    ``batch_shape`` (and the padding mask) to routers whose ``uses_batch_shape`` is True. A
    flat ``[T, D]`` input is one sequence (``"position"`` scope: T positions of batch 1).
    """

    uses_batch_shape = True

    def new_prefix_state(self, rows: int, device: torch.device | str | None = None) -> PrefixState:
        """An empty :class:`PrefixState` for ``rows`` sequences."""
        E = self.config.num_experts
        return PrefixState(
            torch.zeros(rows, 0, E, device=device),
            torch.zeros(rows, 0, dtype=torch.bool, device=device),
        )

    def forward(
        self,
        x_TD: Tensor,
        batch_shape: tuple[int, ...] | None = None,
        token_mask: Tensor | None = None,
        prefix_state: PrefixState | None = None,
    ) -> RoutingPlan:
        return self.plan(self.logits(x_TD), batch_shape, token_mask, prefix_state)

    def _groups(self, T: int, batch_shape: tuple[int, ...] | None) -> tuple[int, int]:
        """(batch rows, positions) of the flat T tokens (row-major)."""
        if batch_shape is None or len(batch_shape) < 2:
            return 1, T
        S = batch_shape[-1]
        return T // S, S

    def plan(
        self,
        logits: Tensor,
        batch_shape: tuple[int, ...] | None = None,
        token_mask: Tensor | None = None,
        prefix_state: PrefixState | None = None,
    ) -> RoutingPlan:
        """Route ``logits`` ``[T, E]`` float32; pairs come out token-major.

        ``prefix_state`` (``causal_prefix`` only): the earlier positions of each row, extended
        in place with this call's positions (incremental decoding).

        Raises:
            ValueError: ``prefix_state`` with another scope, or with a different row count.
        """
        cfg = self.config
        T, E = logits.shape
        R, S = self._groups(T, batch_shape)
        valid = (
            token_mask.reshape(R, S)
            if token_mask is not None
            else torch.ones(R, S, dtype=torch.bool, device=logits.device)
        )
        lg = logits.reshape(R, S, E)
        scope = cfg.selection_scope
        if prefix_state is not None and scope != "causal_prefix":
            raise ValueError(f"prefix_state: only causal_prefix routing has one, not {scope!r}")
        if scope == "causal_prefix":
            mask, w = self._causal_prefix(lg, valid, prefix_state)
        else:
            if scope == "position":
                lg, valid = lg.transpose(0, 1), valid.t()
            elif scope == "batch":
                lg, valid = lg.reshape(1, T, E), valid.reshape(1, T)
            w = unified_scores(lg, cfg.usmoe_rate, cfg.usmoe_expert_score, valid)
            n = budget_pairs_per_group(valid, cfg.top_k, cfg.budget_fraction)
            per_token = cfg.top_k if cfg.usmoe_constraint == "per_token" else None
            per_expert = (n + E - 1) // E if cfg.usmoe_constraint == "per_expert" else None
            with torch.no_grad():
                mask = solve_budgeted_assignment(w.detach(), n, per_token, per_expert, valid)
            if scope == "position":
                mask, w = mask.transpose(0, 1), w.transpose(0, 1)
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

    def _causal_prefix(
        self, lg: Tensor, valid: Tensor, state: PrefixState | None
    ) -> tuple[Tensor, Tensor]:
        """Token t's experts: its entries among the top ``round(f·k·n_t)`` of the prefix
        table ``0..t`` (n_t valid tokens in the prefix). Returns (mask, weights) ``[G, S, E]``
        for this call's S positions; memory ``O(G·(n+S)·E)``."""
        cfg = self.config
        G, S, E = lg.shape
        n0 = 0
        if state is not None:
            if state.logits.shape[0] != G:
                raise ValueError(f"prefix_state: holds {state.logits.shape[0]} rows, got {G}")
            n0 = state.length
            all_lg = torch.cat([state.logits.to(lg.dtype), lg.detach()], dim=1)
            all_valid = torch.cat([state.valid, valid], dim=1)
            state.logits, state.valid = all_lg.detach(), all_valid
        else:
            all_lg, all_valid = lg.detach(), valid
        r, score = cfg.usmoe_rate, cfg.usmoe_expert_score
        token_softmax = r > 0 and score in TOKEN_SOFTMAX_SCORES
        z_all = all_lg.masked_fill(~all_valid.unsqueeze(-1), float("-inf"))
        lse_all = torch.logcumsumexp(z_all, dim=1)  # [G, n, E]: prefix normalisers
        n_t = all_valid.long().cumsum(1)
        budget = torch.floor(cfg.budget_fraction * cfg.top_k * n_t.double() + 0.5).long()
        budget = budget.clamp(min=1).clamp(max=n_t * E)
        w_tok_all = all_lg.softmax(dim=-1)
        static = None if token_softmax else unified_scores(all_lg, r, score)
        thresh = torch.empty(G, S, dtype=all_lg.dtype, device=lg.device)
        with torch.no_grad():
            for i in range(S):
                t = n0 + i
                if token_softmax:
                    alt = _token_softmax_term(z_all[:, : t + 1], lse_all[:, t : t + 1], score)
                    table = (1 - r) * w_tok_all[:, : t + 1] + r * alt
                else:
                    table = static[:, : t + 1]
                table = table.masked_fill(~all_valid[:, : t + 1].unsqueeze(-1), float("-inf"))
                ranked = table.reshape(G, -1).sort(dim=-1, descending=True).values
                b = budget[:, t].clamp(max=ranked.shape[1])
                thresh[:, i] = ranked.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        # Token t's own row of its prefix table, with the graph (for training).
        if token_softmax:
            z = lg.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            # Without a state the prefix normaliser keeps its graph (earlier tokens' logits).
            lse_own = torch.logcumsumexp(z, dim=1) if state is None else lse_all[:, n0:]
            w_own = (1 - r) * lg.softmax(-1) + r * _token_softmax_term(z, lse_own, score)
        else:
            w_own = unified_scores(lg, r, score)
        n_own = n_t[:, n0:]
        mask = (w_own.detach() >= thresh.unsqueeze(-1)) & valid.unsqueeze(-1)
        mask &= (n_own > 0).unsqueeze(-1)
        return mask, w_own


def budget_pairs_per_group(valid_GS: Tensor, top_k: int, fraction: float) -> Tensor:
    """``[G]`` int64 pair budget of each group: :func:`budget_pairs` of its valid tokens."""
    return torch.tensor(
        [budget_pairs(int(v), top_k, fraction) for v in valid_GS.sum(1)],
        device=valid_GS.device,
        dtype=torch.long,
    )
