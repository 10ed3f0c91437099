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
4. The split, by one of two rules (``rule``):

   ``"authors"`` (default; ``cache_planning.py::CachePoolPlanningSimu`` [C]):
   - the CPS weights are scaled to mean 1 (the code's ``w /= mean(w)``), ``p = w / (1 + w)``,
     and the expected number of active experts is ``k' = int(Σ p)``, not ``k``: the hit law
     and the delay model below use ``k'``;
   - grid ``f ∈ {0.01, 0.02, …, 0.99}``; ``n_full = ⌊f·M / slot_full⌋``,
     ``n_sm = ⌊(1-f)·M / slot_sm⌋``; a fraction is *skipped* (not clamped) when
     ``n_full + n_sm > E`` or when either tier is too small to hold every expert once over
     all layers (``n_full·L < E`` or ``n_sm·L < E``), so both tiers always exist;
   - the delays of the feasible fractions, in grid order, are smoothed by a centred rolling
     mean of width 5 (edges average what exists) and the first minimum is taken;
   - no feasible fraction: one token-LFU tier (``kind = "lfu"``); feasible fractions but none
     ``>= 0.3``: the code returns ``f = 0.99`` (its unsmoothed minimum only counts
     ``f >= 0.3``), reproduced here.
   ``"argmin"`` (this project's earlier rule, kept as an ablation [I]): grid ``f ∈ {0, 0.01,
   …, 1}`` with both one-tier splits allowed, slot counts clamped to ``E``, ``k`` itself, and
   the raw argmin of the delay curve (ties to the split with the most full, then SM slots).
   It picks one-tier (all-full) splits wherever a full hit's saving beats two SM hits', which
   the feasibility filter of the authors' rule excludes — so under it the sign-mantissa
   tier, the core of the co-design, is mostly absent.
5. Poisson-binomial DP (``P_j ← P_j (1-p) + P_{j-1} p``) per tier gives the joint law of the hit
   counts ``(h_f, h_s)`` conditioned on ``h_f + h_s + h_rest = k`` (:func:`hit_distribution`).
6. Expected layer delay ``E[max(Compute, IO)]`` (:func:`layer_delay`) with
   ``Compute = chunks·(k-h_f)·T/P · (d_dec + d_sm·CR/chunks)`` and
   ``IO = T·d_sm·(k-h_f-h_s) + h_s·T·d_sm·CR``.
7. Fall back to a single LFU tier for ``k = 1`` (Switch) models or a trace without tokens.

Our choices [I]: inclusion probabilities above 1 are capped and the excess redistributed over
the uncapped ranks until they sum to ``k`` (the code's ``scale_to_k``); ``M`` is the caller's
per-layer byte budget (the code uses ``device_memory_ratio · device memory / #layers``); the
delay constants ``d_dec`` (seconds per chunk decode), ``d_sm`` (seconds per tensor's
sign-mantissa read) and ``CR`` are measured on the store and the machine rather than profiled
on a Jetson.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


PLANNERS = ("authors", "argmin")
MIN_AUTHORS_FRACTION = 0.3  # the code's unsmoothed minimum only counts f >= 0.3


@dataclass
class TierPlan:
    """Slots per layer. ``kind`` is ``"two_tier"`` or ``"lfu"`` (fallback: full slots only);
    ``fraction`` the chosen full-tier share of memory; ``expected_delay_s`` the (unsmoothed)
    expected delay of the chosen split; ``curve`` the expected delay per examined fraction
    (seconds; with ``rule="authors"`` the feasible fractions only, unsmoothed); ``k_eff`` the
    number of active experts the delay model used (``int(Σp)`` for the authors' rule)."""

    kind: str
    n_full: int
    n_sm: int
    fraction: float
    expected_delay_s: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    k_eff: int = 0


def centred_rolling_mean(x: list[float], window: int = 5) -> np.ndarray:
    """``[n]``: the mean of ``x[i - window//2 : i + window//2 + 1]`` clipped to the list
    (pandas' ``rolling(window, center=True, min_periods=1).mean()`` for odd ``window``)."""
    a = np.asarray(x, dtype=np.float64)
    h = window // 2
    return np.array([a[max(0, i - h) : i + h + 1].mean() for i in range(len(a))])


def plan_tiers(
    counts: np.ndarray,
    k: int,
    num_experts: int,
    layer_bytes: float,
    slot_full: int,
    slot_sm: int,
    model: DelayModel,
    *,
    num_layers: int = 1,
    rule: str = "authors",
) -> TierPlan:
    """Choose ``(n_full, n_sm)`` for a per-layer budget of ``layer_bytes`` (see module doc).

    Args:
        counts: routing trace ``[P, L, E]``.
        k: experts per token.
        num_experts: E, experts of the layer.
        layer_bytes: M, bytes per layer.
        slot_full, slot_sm: bytes of one expert decompressed / its sign-mantissa bytes.
        model: the delay constants.
        num_layers: L, sparse layers of the model (the authors' feasibility filter).
        rule: ``"authors"`` (default) or ``"argmin"``.
    Raises:
        ValueError: unknown ``rule`` or ``num_layers < 1``.
    """
    if rule not in PLANNERS:
        raise InvalidValueError(f"rule: must be one of {', '.join(PLANNERS)}; got {rule!r}")
    if num_layers < 1:
        raise InvalidValueError(f"num_layers: must be >= 1, got {num_layers}")
    lfu = TierPlan("lfu", min(num_experts, int(layer_bytes // slot_full)), 0, 1.0, float("nan"))
    if k <= 1:
        return lfu
    try:
        pi = inclusion_probabilities(rank_distribution(counts), k)
    except ValueError:
        return lfu
    w = cps_weights(pi, k)
    if rule == "argmin":
        return _argmin_plan(w, pi, k, num_experts, layer_bytes, slot_full, slot_sm, model, lfu)
    return _authors_plan(w, num_experts, num_layers, layer_bytes, slot_full, slot_sm, model, lfu)


def _authors_plan(
    w: np.ndarray,
    E: int,
    L: int,
    M: float,
    slot_full: int,
    slot_sm: int,
    model: DelayModel,
    lfu: TierPlan,
) -> TierPlan:
    """``CachePoolPlanningSimu`` [C] on CPS weights ``w`` (see the module doc, rule
    ``"authors"``)."""
    w = w / w.mean()
    p = np.minimum(w / (1.0 + w), 1.0 - 1e-9)
    k_eff = int(p.sum())
    fractions, delays, splits = [], [], []
    for i in range(1, 100):
        f = i / 100
        nf, ns = int(f * M // slot_full), int((1 - f) * M // slot_sm)
        if nf + ns > E or nf * L < E or ns * L < E:
            continue
        try:
            H = hit_distribution(p, nf, ns, k_eff)
        except ValueError:  # the code skips fractions where total = k' has probability 0
            continue
        fractions.append(f)
        splits.append((nf, ns))
        delays.append(layer_delay(H, model, k_eff))
    if not fractions:
        return replace(lfu, k_eff=k_eff)
    curve = list(zip(fractions, delays, strict=True))
    if max(fractions) < MIN_AUTHORS_FRACTION:
        nf = min(E, int(0.99 * M // slot_full))
        ns = min(E - nf, int(0.01 * M // slot_sm))
        delay = layer_delay(hit_distribution(p, nf, ns, k_eff), model, k_eff)
        return TierPlan("two_tier" if ns else "lfu", nf, ns, 0.99, delay, curve, k_eff)
    i = int(np.argmin(centred_rolling_mean(delays)))
    nf, ns = splits[i]
    return TierPlan("two_tier", nf, ns, fractions[i], delays[i], curve, k_eff)


def _argmin_plan(
    w: np.ndarray,
    pi: np.ndarray,
    k: int,
    E: int,
    M: float,
    slot_full: int,
    slot_sm: int,
    model: DelayModel,
    lfu: TierPlan,
) -> TierPlan:
    """The earlier rule (module doc, rule ``"argmin"``) [I]."""
    p = w / (1.0 + w)
    p = np.where(pi >= 1.0 - 1e-9, 1.0 - 1e-9, p)
    fractions = np.round(np.arange(0, 101) / 100.0, 2)
    delays, splits = [], []
    for f in fractions:
        nf = min(E, int(f * M // slot_full))
        ns = min(E - nf, int((1 - f) * M // slot_sm))
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
        k,
    )
