"""MESA stage 1: which experts take on safety duties, chosen by optimal transport.

Our reading (the paper's method body was not reachable; see
``docs/methods/mesa.md``): per MoE layer, the experts are ranked by their routing mass on a
mix of safety and general data; the rank percentile ``f`` gives each expert a transport cost
``C(f) = 1 / ((f + α)(100 − f)²)`` [S], low on the "shoulder" of the usage ranking (the cost's
inverse ``∝ f(100 − f)²`` peaks at f = 33.3) and high on the tail. Safety routing mass is
transported from the experts that carry it (top-1 expert ``i``) to target experts ``j``,
regularised towards the empirical co-selection prior ``P_emp[i, j]`` (KL-regularised
Sinkhorn OT [S]); each expert's score is the mass it receives, and the top-``w`` scores are
the selected set.

**A correction [I].** With both marginals fixed and a cost that depends only on the target
expert, ``⟨π, C⟩ = Σ_j c_j b_j`` is the same for every feasible plan, so the plan ignores the
cost (it is the KL projection of ``P_emp`` onto the marginals). We fix only the source
marginal ``a`` (the safety routing mass) and relax the target one:

* semi-relaxed (``rho = 0``), closed form: ``π_ij = a_i K_ij / Σ_j K_ij`` with
  ``K = P_emp ⊙ exp(−C/ε)``;
* unbalanced (``0 < rho < ∞``): POT's ``sinkhorn_unbalanced`` with the source marginal
  exact (``reg_m = (inf, rho)``), a KL penalty ``rho`` towards a uniform target, and
  ``P_emp`` as the KL reference measure (``reg_type="kl"``, ``c=P_emp``); it tends to the
  semi-relaxed plan as ``rho → 0``.

``rho = inf`` (balanced) is refused for a target-only cost, since its plan ignores the cost.

Choices [I]: percentiles at rank midpoints ``f_j = 100 (rank_j + ½) / E`` (rank 0 = most
used), so the last expert's cost stays finite; costs min-max normalised per layer; the prior
counts the pairs (top-1 expert, each selected expert including itself), plus ``1e-6``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from moelab.errors import InvalidValueError, MissingDependencyError

POT_INSTALL = 'pip install "moelab[alignment]"  (POT, the Python Optimal Transport library)'


def _vector(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 1 or x.numel() < 1:
        raise InvalidValueError(f"{name}: expected a non-empty 1-D tensor, got {x!r}")
    return x.double()


def usage_percentiles(mass: Tensor) -> Tensor:
    """Midpoint rank percentiles ``f_j = 100 (rank_j + ½) / E`` of ``mass [E]`` (rank 0 =
    the largest mass; ties keep expert order), float64 ``[E]`` in ``(0, 100)``.

    Raises:
        InvalidValueError: ``mass`` is not a non-empty 1-D tensor.
    """
    mass = _vector(mass, "mass")
    E = mass.numel()
    order = torch.sort(-mass, stable=True).indices
    rank = torch.empty(E, dtype=torch.float64)
    rank[order] = torch.arange(E, dtype=torch.float64)
    return 100.0 * (rank + 0.5) / E


def transport_cost(percentiles: Tensor, alpha: float = 1.0) -> Tensor:
    """MESA's cost ``C(f) = 1 / ((f + α)(100 − f)²)`` [S], min-max normalised to ``[0, 1]``
    [I] (all zeros when every expert has the same cost), float64 ``[E]``.

    Raises:
        InvalidValueError: a percentile outside ``[0, 100)``, or ``alpha <= 0``.
    """
    f = _vector(percentiles, "percentiles")
    if not alpha > 0:
        raise InvalidValueError(f"alpha: must be > 0, got {alpha!r}")
    if bool(((f < 0) | (f >= 100)).any()):
        raise InvalidValueError(f"percentiles: must be in [0, 100), got {f.tolist()}")
    c = 1.0 / ((f + alpha) * (100.0 - f) ** 2)
    span = c.max() - c.min()
    return (c - c.min()) / span if span > 0 else torch.zeros_like(c)


def co_selection_prior(top_idx: Tensor, num_experts: int, floor: float = 1e-6) -> Tensor:
    """Empirical co-selection prior ``P_emp [E, E]`` float64 (sums to 1): the frequency of
    (top-1 expert ``i``, selected expert ``j``) over the tokens' selections ``top_idx [T, k]``
    (column 0 = top-1; ``j`` runs over all k, the top-1 itself included), plus ``floor``.

    Raises:
        InvalidValueError: ``top_idx`` not an integer ``[T, k]`` tensor with ids in ``[0, E)``.
    """
    if (
        not isinstance(top_idx, Tensor)
        or top_idx.dim() != 2
        or top_idx.dtype.is_floating_point
        or top_idx.numel() == 0
        or int(top_idx.min()) < 0
        or int(top_idx.max()) >= num_experts
    ):
        raise InvalidValueError(
            f"top_idx: expected an integer [T, k] tensor of ids in [0, {num_experts})"
        )
    counts = torch.zeros(num_experts, num_experts, dtype=torch.float64)
    first = top_idx[:, :1].expand_as(top_idx).reshape(-1)
    counts.index_put_(
        (first, top_idx.reshape(-1)),
        torch.ones(first.numel(), dtype=torch.float64),
        accumulate=True,
    )
    prior = counts / counts.sum() + floor
    return prior / prior.sum()


def transport_plan(
    source: Tensor, cost: Tensor, prior: Tensor, epsilon: float = 0.05, rho: float = 0.0
) -> Tensor:
    """The KL(π‖P_emp)-regularised transport plan ``π [E, E]`` float64 from the safety
    routing mass ``source [E]`` (rows) to target experts (columns) at per-target ``cost [E]``.

    Args:
        source: ``a``, the source marginal (sums to 1); every row of the plan sums to it.
        cost: ``c [E]``, the cost of sending mass to expert j (the same from every source).
        prior: ``P_emp [E, E]``, positive.
        epsilon: ε > 0, the KL weight; smaller lets the cost matter more.
        rho: the target marginal's KL penalty: 0 = semi-relaxed (closed form, no POT),
            ``0 < rho < inf`` = unbalanced towards a uniform target (POT).
    Raises:
        InvalidValueError: bad shapes, ε <= 0, a negative source or non-positive prior,
            ``rho`` negative or infinite (balanced OT with a target-only cost ignores the
            cost, module docstring).
        MissingDependencyError: ``0 < rho`` and POT is not installed.
    """
    a, c = _vector(source, "source"), _vector(cost, "cost")
    E = a.numel()
    if c.numel() != E or not isinstance(prior, Tensor) or prior.shape != (E, E):
        raise InvalidValueError(f"cost, prior: expected [{E}] and [{E}, {E}] for {E} experts")
    if not epsilon > 0:
        raise InvalidValueError(f"epsilon: must be > 0, got {epsilon!r}")
    if bool((a < 0).any()) or not math.isclose(float(a.sum()), 1.0, rel_tol=1e-6):
        raise InvalidValueError(f"source: must be >= 0 and sum to 1, got {a.tolist()}")
    if not bool((prior > 0).all()):
        raise InvalidValueError("prior: must be positive everywhere (add a floor)")
    if not 0 <= rho < math.inf:
        raise InvalidValueError(
            f"rho: must be in [0, inf), got {rho!r}; balanced OT (rho = inf) with a cost that "
            "depends only on the target expert gives a plan that ignores the cost"
        )
    p = prior.double()
    if rho == 0:
        kernel = p * torch.exp(-c / epsilon)[None, :]
        return a[:, None] * kernel / kernel.sum(dim=1, keepdim=True)
    try:
        import ot
    except ImportError as e:
        raise MissingDependencyError(f"unbalanced transport needs POT: {POT_INSTALL}") from e
    plan = ot.unbalanced.sinkhorn_unbalanced(
        a.numpy(),
        np.full(E, 1.0 / E),
        c[None, :].expand(E, E).numpy(),
        reg=epsilon,
        reg_m=(math.inf, rho),
        reg_type="kl",
        c=p.numpy(),  # the KL reference measure: P_emp
        numItermax=10_000,
        stopThr=1e-12,
    )
    return torch.as_tensor(plan, dtype=torch.float64)


def expert_scores(plan: Tensor) -> Tensor:
    """``s_j = Σ_i π_ij``: the safety mass each expert receives, float64 ``[E]``."""
    return plan.double().sum(dim=0)


def select_top(scores: Tensor, w: int) -> list[int]:
    """The ``w`` experts with the largest ``scores [E]`` (ties: lower id first), sorted.

    Raises:
        InvalidValueError: ``w`` not in ``[1, E]``.
    """
    s = _vector(scores, "scores")
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= s.numel():
        raise InvalidValueError(f"w: must be an int in [1, {s.numel()}], got {w!r}")
    return sorted(torch.sort(-s, stable=True).indices[:w].tolist())
