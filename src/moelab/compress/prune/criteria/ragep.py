"""RaGEP Stage 2: Spectral-Salience expert selection.

Paper: Hu et al., "RaGEP: Rank-aware Geometric Expert Pruning for Mixture-of-Experts Language
Models", ICML 2026 (no arXiv id); code github.com/Saul-James/RaGEP, ``ESNAccumulator`` and
``stage2_esn_pruning`` of ``code/Mixtral 8x7B/ragep_mixtral_prune.py``. Stage 1 (the budgets)
is :func:`moelab.compress.prune.budget.rank_budget`.

As the authors' code does [C]:

- layers are processed one after another and the calibration set is re-run for each, so a
  layer's statistics come from the model whose earlier layers are already pruned
  (``sequential = True``);
- for every routed pair take the gate-weighted output ``o = g̃_e(x) · f_e(x)``;
  ``Energy_e = Σ ‖o‖₂`` (a sum: it grows with routing frequency);
- directions ``u = o/‖o‖``; ``Σ_e = E[u uᵀ] − E[u] E[u]ᵀ``; basis ``U_e`` = the top-r
  eigenvectors of Σ_e, only for experts with at least r routed pairs (Mixtral script);
- Expert Subspace Novelty ``ESN_e = clip(1 − ‖Q_{−e}ᵀ U_e‖_F² / r, 0, 1)`` where ``Q_{−e}`` is
  an orthonormal basis of ``[U_j]_{j≠e}`` over the experts that have a basis; 1 when no other
  expert has one, 0 for an expert without a basis. (When ``(E−1)·r ≥ D`` the others span the
  whole space and every ESN is 0.)
- ``S_e = (1−β)·rank01(ESN_e) + β·rank01(Energy_e)``, ``rank01`` = ordinal rank (stable
  ``argsort(argsort(·))``) / (E − 1 + 1e-6); keep the ``n_l`` highest, ties to the higher
  index (``argsort(S)[::-1]``).

Choices of this project [I]: by default (``span="svd"``) ``Q_{−e}`` comes from an SVD that
keeps the singular directions above ``1e-10 · σ_max`` where the authors take a reduced QR: the
same span when the other bases are linearly independent (the generic case), but the true span
when they are not (a reduced QR of dependent columns returns extra arbitrary directions, so a
duplicated expert, as in an upcycled model, would make every other expert look redundant).
``span="qr"`` is the authors' rule for exact reproduction: a reduced QR of the other bases in
float32. The gate g̃ and expert outputs are the layer's own routing (the
authors recompute Mixtral's softmax → top-k → renormalise, which is what these models do); all
statistics, eigendecompositions and the QR run in float64 (the authors cast bases to float32);
the default rank r = 8 (the authors use 32 at d_model 4096, 16 for Qwen3) so that
``(E−1)·r < d_model`` for the 8- and 16-expert models at d_model 192; the default β = 0.5 is the
Mixtral setting (0.8 DeepSeek-V2-Lite, 1.0 Qwen3). Ties (e.g. ESN = 0 for every expert without
a basis) are ordered by index with stable sorts; the authors' NumPy default sort is not stable
in general (NumPy 2's SIMD sorts on AVX-512 CPUs), so their tie order depends on the machine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moelab.compress.prune.criteria.base import ScoreCriterion, Selection, top_n
from moelab.compress.stats import LayerStats
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError


def subspace_bases(stats: LayerStats, rank: int) -> dict[int, Tensor]:
    """``{expert: U_e [D, r] float64}``: top-``rank`` eigenvectors of each expert's direction
    covariance, for the experts with at least ``rank`` routed pairs."""
    bases = {}
    for e in range(stats.num_experts):
        if int(stats.counts[e]) < rank:
            continue
        _, vecs = torch.linalg.eigh(stats.direction_covariance(e))
        bases[e] = vecs[:, -rank:]
    return bases


def orthonormal_span(a: Tensor, rtol: float = 1e-10) -> Tensor:
    """``[D, rank(a)]`` orthonormal basis of the column span of ``a`` ``[D, m]`` (left singular
    vectors with singular value above ``rtol · max``)."""
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    return u[:, s > rtol * s.max()] if s.numel() else u


SPANS = ("svd", "qr")
"""How ``Q_{−e}`` is built: ``"svd"`` (the true span) or ``"qr"`` (the authors' reduced QR)."""


def subspace_novelty(
    bases: dict[int, Tensor], num_experts: int, rank: int, span: str = "svd"
) -> Tensor:
    """ESN ``[E]`` float64 from the bases (0 for experts without one).

    ``ESN_e = clip(1 − ‖Q_{−e}ᵀ U_e‖_F² / r, 0, 1)``: one minus the mean squared cosine of the
    principal angles between e's subspace and the span of the other experts' subspaces;
    ``Q_{−e}`` by :func:`orthonormal_span` (``span="svd"``) or, as the authors' code, the
    reduced QR of the other bases in float32 (``"qr"``).

    Raises:
        InvalidValueError: an unknown ``span``.
    """
    if span not in SPANS:
        raise InvalidValueError(f"span: must be svd or qr, got {span!r}")
    esn = torch.zeros(num_experts, dtype=torch.float64)
    valid = sorted(bases)
    for e in valid:
        others = [bases[j] for j in valid if j != e]
        if not others:
            esn[e] = 1.0
            continue
        if span == "qr":
            q, _ = torch.linalg.qr(torch.cat(others, dim=1).float(), mode="reduced")
            proj = float((q.T @ bases[e].float()).pow(2).sum()) / rank
        else:
            q = orthonormal_span(torch.cat(others, dim=1))
            proj = float((q.T @ bases[e]).pow(2).sum()) / rank
        esn[e] = 1.0 - min(max(proj, 0.0), 1.0)
    return esn


def rank01(x: Tensor) -> Tensor:
    """Ordinal rank / (E − 1 + 1e-6), ties by index (stable ``argsort(argsort(x))``)."""
    r = torch.argsort(torch.argsort(x.to(torch.float64), stable=True), stable=True)
    return r.to(torch.float64) / (x.numel() - 1 + 1e-6)


class SpectralSalience(ScoreCriterion):
    """RaGEP's score ``(1−β)·rank01(ESN) + β·rank01(Energy)``.

    Args:
        pca_rank: r, the dimension of each expert's subspace (>= 1).
        beta: β in [0, 1]; 1 = energy only (the authors' Qwen3 setting).
        span: ``"svd"`` (default) or ``"qr"`` (the authors' rule), see :func:`subspace_novelty`.
    Raises:
        ValueError: out-of-range settings, or ``pca_rank`` above d_model (at selection).
    """

    name = "ragep"
    sequential = True
    directions = True

    def __init__(self, pca_rank: int = 8, beta: float = 0.5, span: str = "svd") -> None:
        if not isinstance(pca_rank, int) or pca_rank < 1:
            raise InvalidValueError(f"pca_rank: must be an int >= 1, got {pca_rank!r}")
        if not 0.0 <= beta <= 1.0:
            raise InvalidValueError(f"beta: must be in [0, 1], got {beta}")
        if span not in SPANS:
            raise InvalidValueError(f"span: must be svd or qr, got {span!r}")
        self.pca_rank, self.beta, self.span = pca_rank, beta, span

    def options(self) -> dict[str, Any]:
        return {"pca_rank": self.pca_rank, "beta": self.beta, "span": self.span}

    def accumulator(self, layer: MoELayer, n_keep: int) -> LayerStats:
        D = layer.config.experts.hidden_size
        if self.pca_rank > D:
            raise InvalidValueError(f"pca_rank: must be <= d_model={D}, got {self.pca_rank}")
        return super().accumulator(layer, n_keep)

    def scores(self, stats: LayerStats) -> tuple[Tensor, dict[str, Tensor]]:
        E = stats.num_experts
        esn = subspace_novelty(subspace_bases(stats, self.pca_rank), E, self.pca_rank, self.span)
        energy = stats.energy.clone()
        score = (1 - self.beta) * rank01(esn) + self.beta * rank01(energy)
        return score, {"esn": esn, "energy": energy}

    def select(self, acc: LayerStats, n_keep: int) -> Selection:
        score, details = self.scores(acc)
        return Selection(
            keep=top_n(score, n_keep, prefer_high_index=True),
            scores=score.tolist(),
            details={k: v.tolist() for k, v in details.items()},
        )
