"""ZipMoE's cache planner: how much of a layer's memory to give the full tier and how much the
sign-mantissa tier (the authors' ``runtime/cache_planning.py`` as the project's research notes,
section (c), describe it).

1. Rank-based activation distribution from a routing trace ``counts [P, L, E]`` (tokens routed
   to each expert per prompt and layer): sort each (prompt, layer) row in descending order and
   sum the rows (:func:`rank_distribution`). Rank ``r`` is "the r-th most used expert of a
   layer", so the tiers hold the top-ranked experts.
2. Inclusion probabilities summing to ``k`` (:func:`inclusion_probabilities`).
3. Conditional-Poisson-sampling (CPS) weights by the Chen–Dempster–Liu (1994) fixed point
   ``w ← w · π_target / π(w)`` with ``π_i(w) = w_i · e_{k-1}(w_{-i}) / e_k(w)`` from elementary
   symmetric sums (:func:`cps_weights`); Bernoulli ``p_i = w_i / (1 + w_i)``, whose
   independent draws conditioned on exactly ``k`` successes are that CPS design.
4. For each full-tier fraction ``f ∈ {0, 0.01, …, 1}``: ``n_full = ⌊f·M / slot_full⌋`` and
   ``n_sm = ⌊(1-f)·M / slot_sm⌋``; ranks ``[0, n_full)`` are full, the next ``n_sm`` SM.
5. Poisson-binomial DP (``P_j ← P_j (1-p) + P_{j-1} p``) per tier gives the joint law of the hit
   counts ``(h_f, h_s)`` conditioned on ``h_f + h_s + h_rest = k`` (:func:`hit_distribution`).
6. Expected layer delay ``E[max(Compute, IO)]`` (:func:`layer_delay`) with
   ``Compute = chunks·(k-h_f)·T/P · (d_dec + d_sm·CR/chunks)`` and
   ``IO = T·d_sm·(k-h_f-h_s) + h_s·T·d_sm·CR``.
7. Take the split with the least expected delay. [Ours, not the code's: the code smooths the
   delay curve over ``f`` with a window of 5 before the argmin. The curve is analytic, so
   smoothing removes no noise, but it makes a split that the grid reaches at only one or two
   values of ``f`` lose to any wide plateau. Such splits occur whenever the budget is an exact
   multiple of the slot sizes. On the upcycled SmolLM2-MoE at 25 % of the expert bytes, the
   smoothed argmin was 1F+1SM (10.1 ms expected per layer step) instead of 2F+0SM (8.4 ms);
   two runs under a 300 MB/s cap measured 566 and 503 ms per output token with them.]
8. Fall back to a single LFU tier when no split is feasible or for ``k = 1`` (Switch) models.

Our choices [I]: the grid includes ``f = 0`` and ``f = 1`` (the code's ``0.01 … 0.99`` misses
"all SM" and "all full" when the budget is an exact multiple of the slot size); inclusion
probabilities above 1 are capped and the excess redistributed over the uncapped ranks until
they sum to ``k``; ``M`` is the caller's per-layer byte budget (the code uses
``0.95 · device memory / #layers``); the delay constants ``d_dec`` (seconds per chunk decode),
``d_sm`` (seconds per tensor's sign-mantissa read) and ``CR`` are measured on the store and
the machine rather than profiled on a Jetson.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from moelab.errors import InvalidValueError


def rank_distribution(counts: np.ndarray) -> np.ndarray:
    """``[P, L, E]`` (or ``[L, E]``) token counts → ``[E]`` activation mass per rank, summing
    to 1 (rank 0 = the most used expert of each layer).

    Raises:
        ValueError: wrong rank, negative counts, or no tokens at all.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3:
        raise InvalidValueError(f"counts: expected [P, L, E] or [L, E], got shape {c.shape}")
    if (c < 0).any():
        raise InvalidValueError("counts: must be >= 0")
    ranked = -np.sort(-c, axis=-1)
    total = ranked.reshape(-1, c.shape[-1]).sum(0)
    if total.sum() <= 0:
        raise InvalidValueError("counts: the trace routes no tokens")
    return total / total.sum()


def inclusion_probabilities(dist: np.ndarray, k: int) -> np.ndarray:
    """Scale ``dist [E]`` to probabilities ``π ∈ [0, 1]`` with ``Σ π = k`` (iterative capping).

    Raises:
        ValueError: ``k`` outside ``[1, #nonzero entries]``.
    """
    d = np.asarray(dist, dtype=np.float64)
    if not 1 <= k <= int((d > 0).sum()):
        raise InvalidValueError(
            f"k: must be in [1, {int((d > 0).sum())}] for this distribution, got {k}"
        )
    pi = np.zeros_like(d)
    capped = np.zeros(d.shape, dtype=bool)
    for _ in range(d.shape[0] + 1):
        free = ~capped
        rest = k - capped.sum()
        pi[free] = d[free] * rest / d[free].sum()
        pi[capped] = 1.0
        over = free & (pi > 1.0)
        if not over.any():
            break
        capped |= over
    return np.clip(pi, 0.0, 1.0)


def elementary_symmetric(w: np.ndarray, k: int) -> np.ndarray:
    """``[k+1]``: ``e_j(w) = Σ_{|S|=j} Π_{i∈S} w_i`` for ``j = 0..k`` (DP over the entries)."""
    e = np.zeros(k + 1)
    e[0] = 1.0
    for x in np.asarray(w, dtype=np.float64):
        e[1:] = e[1:] + x * e[:-1]
    return e


def cps_inclusion(w: np.ndarray, k: int) -> np.ndarray:
    """Inclusion probabilities of conditional Poisson sampling of size ``k`` with weights ``w``:
    ``π_i = w_i · e_{k-1}(w_{-i}) / e_k(w)`` (leave-one-out sums by a vectorised DP)."""
    w = np.asarray(w, dtype=np.float64)
    E = w.shape[0]
    loo = np.zeros((E, k))  # loo[i, j] = e_j(w without i), j = 0..k-1
    loo[:, 0] = 1.0
    for j, x in enumerate(w):
        upd = loo.copy()
        upd[:, 1:] = loo[:, 1:] + x * loo[:, :-1]
        upd[j] = loo[j]  # entry j is left out of its own row
        loo = upd
    ek = elementary_symmetric(w, k)[k]
    return w * loo[:, k - 1] / ek


def cps_weights(pi: np.ndarray, k: int, iters: int = 500, tol: float = 1e-12) -> np.ndarray:
    """Chen–Dempster–Liu fixed point: CPS weights whose size-``k`` inclusion probabilities are
    ``pi`` (entries 0 stay 0; entries 1 get a large finite weight)."""
    pi = np.clip(np.asarray(pi, dtype=np.float64), 0.0, 1.0 - 1e-9)
    w = pi / (1.0 - pi)
    pos = w > 0
    for _ in range(iters):
        cur = cps_inclusion(w, k)
        ratio = np.ones_like(w)
        ratio[pos] = pi[pos] / np.maximum(cur[pos], 1e-300)
        w = w * ratio
        w = w / w[pos].max()  # CPS is invariant to scaling w; keep it bounded
        if np.abs(cur[pos] - pi[pos]).max() < tol:
            break
    return w


def poisson_binomial(p: np.ndarray) -> np.ndarray:
    """``[n+1]``: P(exactly j successes) of independent Bernoulli(p_i) (the DP
    ``P_j ← P_j (1-p) + P_{j-1} p``)."""
    P = np.zeros(len(p) + 1)
    P[0] = 1.0
    for x in np.asarray(p, dtype=np.float64):
        P[1:] = P[1:] * (1 - x) + P[:-1] * x
        P[0] *= 1 - x
    return P


def hit_distribution(p: np.ndarray, n_full: int, n_sm: int, k: int) -> np.ndarray:
    """Joint law ``H[a, b] = P(h_f = a, h_s = b | total = k)`` ``[k+1, k+1]``: Bernoulli ``p``
    over ranks, ranks ``[0, n_full)`` full, ``[n_full, n_full+n_sm)`` SM, the rest uncached."""
    p = np.asarray(p, dtype=np.float64)
    nf = min(n_full, len(p))
    ns = min(n_sm, len(p) - nf)
    pf = poisson_binomial(p[:nf])
    ps = poisson_binomial(p[nf : nf + ns])
    pr = poisson_binomial(p[nf + ns :])
    H = np.zeros((k + 1, k + 1))
    for a in range(min(k, nf) + 1):
        for b in range(min(k - a, ns) + 1):
            c = k - a - b
            if c < len(pr):
                H[a, b] = pf[a] * ps[b] * pr[c]
    z = H.sum()
    if z <= 0:
        raise InvalidValueError("hit_distribution: total = k has probability 0 under p")
    return H / z


def hit_distribution_bruteforce(p: np.ndarray, n_full: int, n_sm: int, k: int) -> np.ndarray:
    """:func:`hit_distribution` by enumerating all ``2^E`` outcomes (tests; small E only)."""
    p = np.asarray(p, dtype=np.float64)
    E = len(p)
    H = np.zeros((k + 1, k + 1))
    for bits in itertools.product((0, 1), repeat=E):
        if sum(bits) != k:
            continue
        prob = float(np.prod([p[i] if b else 1 - p[i] for i, b in enumerate(bits)]))
        a = sum(bits[:n_full])
        b = sum(bits[n_full : n_full + n_sm])
        H[a, b] += prob
    return H / H.sum()


@dataclass(frozen=True)
class DelayModel:
    """Constants of the layer delay model (seconds, measured on this store and machine).

    Attributes:
        tensors: T, tensors per expert.
        threads: P, decompression threads.
        chunks: exponent chunks per tensor.
        d_dec: seconds to decode one exponent chunk.
        d_sm: seconds to read one tensor's sign-mantissa bytes.
        cr: exponent compression ratio (compressed / raw exponent bytes).
    """

    tensors: int
    threads: int
    chunks: int
    d_dec: float
    d_sm: float
    cr: float

    def delay(self, h_f: int, h_s: int, k: int) -> float:
        """``max(Compute, IO)`` of one layer step with ``h_f`` full and ``h_s`` SM hits."""
        T, P, C = self.tensors, self.threads, self.chunks
        compute = C * (k - h_f) * T / P * (self.d_dec + self.d_sm * self.cr / C)
        io = T * self.d_sm * (k - h_f - h_s) + h_s * T * self.d_sm * self.cr
        return max(compute, io)


def layer_delay(H: np.ndarray, model: DelayModel, k: int) -> float:
    """``E[max(Compute, IO)]`` under the hit law ``H`` (:func:`hit_distribution`)."""
    return float(
        sum(H[a, b] * model.delay(a, b, k) for a in range(k + 1) for b in range(k + 1 - a))
    )


@dataclass
class TierPlan:
    """Slots per layer. ``kind`` is ``"two_tier"`` or ``"lfu"`` (fallback: full slots only);
    ``fraction`` the chosen full-tier share of memory (the smallest that gives the split);
    ``curve`` the expected delay per fraction (seconds)."""

    kind: str
    n_full: int
    n_sm: int
    fraction: float
    expected_delay_s: float
    curve: list[tuple[float, float]] = field(default_factory=list)


def plan_tiers(
    counts: np.ndarray,
    k: int,
    num_experts: int,
    layer_bytes: float,
    slot_full: int,
    slot_sm: int,
    model: DelayModel,
) -> TierPlan:
    """Choose ``(n_full, n_sm)`` for a per-layer budget of ``layer_bytes`` (see module doc).

    Args:
        counts: routing trace ``[P, L, E]``.
        k: experts per token.
        layer_bytes: M, bytes per layer.
        slot_full, slot_sm: bytes of one expert decompressed / its sign-mantissa bytes.
    """
    lfu = TierPlan("lfu", min(num_experts, int(layer_bytes // slot_full)), 0, 1.0, float("nan"))
    if k <= 1:
        return lfu
    try:
        pi = inclusion_probabilities(rank_distribution(counts), k)
    except ValueError:
        return lfu
    p_w = cps_weights(pi, k)
    p = p_w / (1.0 + p_w)
    p = np.where(pi >= 1.0 - 1e-9, 1.0 - 1e-9, p)
    fractions = np.round(np.arange(0, 101) / 100.0, 2)
    delays, splits = [], []
    for f in fractions:
        nf = min(num_experts, int(f * layer_bytes // slot_full))
        ns = min(num_experts - nf, int((1 - f) * layer_bytes // slot_sm))
        splits.append((nf, ns))
        delays.append(layer_delay(hit_distribution(p, nf, ns, k), model, k))
    if not any(nf + ns for nf, ns in splits):
        return lfu
    # Splits whose delays differ only by rounding (a flat stretch of the curve) are ties:
    # take the one that holds the most (full, then sign-mantissa) slots [our choice], so the
    # plan does not depend on the last bits of the sums.
    best = min(delays)
    tied = [j for j, d in enumerate(delays) if d <= best + 1e-9 * abs(best)]
    i = max(tied, key=lambda j: (splits[j], -j))
    nf, ns = splits[i]
    return TierPlan(
        "two_tier",
        nf,
        ns,
        float(fractions[i]),
        float(delays[i]),
        list(zip(fractions.tolist(), delays, strict=True)),
    )
