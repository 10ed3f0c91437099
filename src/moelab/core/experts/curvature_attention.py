"""Curvature-aware cross-attention between modality experts: EEG-MoCE's "mixture".

EEG-MoCE (arXiv 2604.12579; authors' ``CurvatureAwareCrossAttention`` in
``nets/HMultimodalNet.py``) mixes its per-modality experts by attention among their points on
one fusion manifold (parameter ``k_f``). For M modality points ``x_m`` and each head::

    q_m, c_m, v_m = HypLinear_q/k/v(x_m)
    s_ij  = (2 k_f + 2 ⟨q_i, c_j⟩_L) / τ_i + λ · log|K_j|       (2k_f + 2⟨q,c⟩_L = −d²_L)
    τ_i   = τ_0 / √|K_i|,   |K_m| = 1 / (k_m + 1e-6),   λ = softplus(λ_raw)
    a_ij  = softmax_j(s_ij) with the diagonal masked (a modality attends only to the others)
    y_i   = midpoint_j(v_j; a_ij)                               (weighted Lorentz centroid)

and the heads are merged by an equal-weight midpoint. ``τ_0`` is learnable (init √D'), the
prior is used in the first fusion layer only. **The curvatures are detached** here, as in the
code: the fusion sends no gradient to ``k_m`` (it gets gradient through its own stack and the
curvature projection only). ``curvature_aware=False`` is the ablation without both terms
(``τ_i = τ_0``, no prior).

The attention weights are the method's "expert weights"; :func:`attention_plan` turns them
into a :class:`~moelab.core.plan.RoutingPlan` (one token per (sample, query modality), its
pairs the other modalities with their attention) so :class:`~moelab.core.telemetry.RoutingRecord`
and the analysis code can report them; :func:`attention_received` is the code's "modality
contribution" (``_compute_modality_contributions``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.experts.hyperbolic import HypLinear
from moelab.core.experts.lorentz import midpoint, pairwise_inner
from moelab.core.plan import RoutingPlan
from moelab.errors import InvalidValueError

_EPS = 1e-6  # the code's eps in |K| = 1/(k + eps) and log(|K| + eps)


class CurvatureAwareCrossAttention(nn.Module):
    """One layer of curvature-aware cross-attention on the fusion manifold.

    Args:
        in_features, out_features: space widths D and D' (points are ``D+1``, ``D'+1``).
        num_heads: heads (each with its own Q/K/V :class:`HypLinear`).
        curvature_aware: use ``τ_0/√|K_i|`` and the prior ``λ log|K_j|`` (False: ``τ_0`` and
            no prior: the "no curvature-aware fusion" ablation).
        use_prior: add the prior (the code: first layer only).
        prior_init: initial ``λ`` (the code's ``main``: 0.3).

    ``forward(x [B, M, D+1], k_f, ks [M]) → (y [B, M, D'+1], attn [B, H, M, M])``; ``attn``
    has a zero diagonal and rows summing to 1.

    Raises:
        InvalidValueError: fewer than 2 modalities, or ``ks`` not of length M.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_heads: int,
        *,
        curvature_aware: bool = True,
        use_prior: bool = True,
        prior_init: float = 0.3,
    ) -> None:
        super().__init__()
        self.q = nn.ModuleList(HypLinear(in_features, out_features) for _ in range(num_heads))
        self.k = nn.ModuleList(HypLinear(in_features, out_features) for _ in range(num_heads))
        self.v = nn.ModuleList(HypLinear(in_features, out_features) for _ in range(num_heads))
        self.tau0 = nn.Parameter(torch.tensor(math.sqrt(out_features)))
        self.curvature_aware = curvature_aware
        self.prior_raw = None
        if curvature_aware and use_prior:
            # softplus⁻¹(prior_init), as the code initialises it
            self.prior_raw = nn.Parameter(torch.tensor(math.log(math.expm1(prior_init))))

    def forward(self, x: Tensor, k_f: Tensor, ks: Tensor) -> tuple[Tensor, Tensor]:
        M = x.shape[1]
        if M < 2:
            raise InvalidValueError(f"cross-attention needs >= 2 modalities, got {M}")
        if ks.shape != (M,):
            raise InvalidValueError(
                f"ks: must hold one k per modality ({M}), got {tuple(ks.shape)}"
            )
        mag = 1.0 / (ks.detach() + _EPS)  # |K_m|, no gradient into k_m (the code's .detach())
        tau = self.tau0 / (mag + _EPS).sqrt() if self.curvature_aware else self.tau0.expand(M)
        bias = 0.0
        if self.prior_raw is not None:
            bias = F.softplus(self.prior_raw) * torch.log(mag + _EPS)
        diag = torch.eye(M, dtype=torch.bool, device=x.device)
        heads, attns = [], []
        for wq, wk, wv in zip(self.q, self.k, self.v, strict=True):
            q, c, v = wq(x, k_f), wk(x, k_f), wv(x, k_f)
            scores = (2 * k_f + 2 * pairwise_inner(q, c)) / tau.view(M, 1) + bias
            attn = scores.masked_fill(diag, float("-inf")).softmax(-1)
            heads.append(midpoint(v, k_f, attn))
            attns.append(attn)
        y = midpoint(torch.stack(heads, dim=-2), k_f)  # [B, M, H, D'+1] → [B, M, D'+1]
        return y, torch.stack(attns, dim=1)


def attention_received(attn: Tensor) -> Tensor:
    """Share of the cross-attention each modality receives (the code's "contribution").

    ``attn``: ``[L, B, H, M, M]`` (layers) or ``[B, H, M, M]``, rows = queries. Averaged over
    layers and heads, the column sums (diagonal excluded) are normalised per sample and
    averaged over the batch: ``[M]``, summing to 1.
    """
    if attn.dim() == 4:
        attn = attn.unsqueeze(0)
    M = attn.shape[-1]
    avg = attn.mean(dim=(0, 2))  # [B, M, M]
    avg = avg * (1 - torch.eye(M, dtype=avg.dtype, device=avg.device))
    received = avg.sum(dim=1)  # [B, M]: over queries
    return (received / (received.sum(-1, keepdim=True) + 1e-8)).mean(0)


def attention_plan(attn: Tensor) -> RoutingPlan:
    """The attention of one fusion layer as a :class:`RoutingPlan` for telemetry.

    ``attn``: ``[B, H, M, M]``; heads are averaged. Token ``b·M + i`` is modality i of sample
    b (the query); its pairs are the other modalities j with weight ``a_ij`` (float32);
    ``probs[t]`` is the attention row, ``logits`` its log (``-inf`` clamped to ``log 1e-30``).
    Only telemetry reads it: nothing is dispatched.
    """
    B, _, M, _ = attn.shape
    probs = attn.detach().mean(1).reshape(B * M, M).float()
    token = torch.arange(B * M).repeat_interleave(M - 1)
    expert = torch.tensor([j for i in range(M) for j in range(M) if j != i]).repeat(B)
    return RoutingPlan(
        token_idx=token,
        expert_idx=expert,
        weight=probs[token, expert],
        logits=probs.clamp_min(1e-30).log(),
        probs=probs,
        num_experts=M,
    )
