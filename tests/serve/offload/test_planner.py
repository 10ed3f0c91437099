"""ZipMoE's cache planner: rank distribution, CPS weights, Poisson-binomial hit law, tiers."""

import itertools

import numpy as np
import pytest

from moelab.serve.offload.planner import (
    DelayModel,
    centred_rolling_mean,
    cps_inclusion,
    cps_weights,
    elementary_symmetric,
    hit_distribution,
    inclusion_probabilities,
    layer_delay,
    plan_tiers,
    poisson_binomial,
    rank_distribution,
)


def hit_distribution_bruteforce(p, n_full, n_sm, k):
    """:func:`hit_distribution` by enumerating all ``2^E`` outcomes (small E only)."""
    H = np.zeros((k + 1, k + 1))
    for bits in itertools.product((0, 1), repeat=len(p)):
        if sum(bits) != k:
            continue
        prob = float(np.prod([p[i] if b else 1 - p[i] for i, b in enumerate(bits)]))
        H[sum(bits[:n_full]), sum(bits[n_full : n_full + n_sm])] += prob
    return H / H.sum()


def test_rank_distribution_by_hand():
    # two layers: [0, 3, 1] sorts to [3, 1, 0]; [2, 2, 0] to [2, 2, 0]; total [5, 3, 0] / 8
    counts = np.array([[[0, 3, 1], [2, 2, 0]]])
    assert rank_distribution(counts).tolist() == pytest.approx([5 / 8, 3 / 8, 0])
    with pytest.raises(ValueError, match="no tokens"):
        rank_distribution(np.zeros((1, 2, 3)))


def test_inclusion_probabilities_cap_and_sum_to_k():
    pi = inclusion_probabilities(np.array([0.7, 0.1, 0.1, 0.1]), 2)
    # 0.7·2 = 1.4 is capped at 1; the other 1 is shared equally by the rest
    assert pi.tolist() == pytest.approx([1, 1 / 3, 1 / 3, 1 / 3])
    with pytest.raises(ValueError, match="k"):
        inclusion_probabilities(np.array([1.0, 0, 0]), 2)


def test_elementary_symmetric_and_cps_inclusion_by_enumeration():
    w = np.array([0.5, 2.0, 1.0, 3.0])
    e = elementary_symmetric(w, 3)
    assert e[2] == pytest.approx(sum(a * b for a, b in itertools.combinations(w, 2)))
    pi = cps_inclusion(w, 2)
    subsets = list(itertools.combinations(range(4), 2))
    z = sum(w[i] * w[j] for i, j in subsets)
    brute = [sum(w[i] * w[j] for i, j in subsets if x in (i, j)) / z for x in range(4)]
    assert pi.tolist() == pytest.approx(brute)
    assert pi.sum() == pytest.approx(2)


def test_cps_weights_reproduce_the_target():
    target = np.array([0.9, 0.5, 0.3, 0.2, 0.1])
    target = target * 2 / target.sum()
    w = cps_weights(target, 2)
    assert cps_inclusion(w, 2) == pytest.approx(target, abs=1e-9)


def test_poisson_binomial_dp_equals_enumeration():
    rng = np.random.default_rng(0)
    for E in (1, 3, 6, 9):
        p = rng.random(E)
        brute = np.zeros(E + 1)
        for bits in itertools.product((0, 1), repeat=E):
            brute[sum(bits)] += np.prod([p[i] if b else 1 - p[i] for i, b in enumerate(bits)])
        assert poisson_binomial(p) == pytest.approx(brute, abs=1e-12)
        for k in range(1, min(E, 4) + 1):
            for nf in range(E + 1):
                for ns in range(E - nf + 1):
                    assert hit_distribution(p, nf, ns, k) == pytest.approx(
                        hit_distribution_bruteforce(p, nf, ns, k), abs=1e-12
                    ), (E, k, nf, ns)


def test_delay_model_by_hand():
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=1.0, d_sm=10.0, cr=0.4)
    # miss both: compute = 5·2·2/2·(1 + 10·0.4/5) = 18; io = 2·10·2 = 40
    assert m.delay(0, 0, 2) == pytest.approx(40)
    # one SM hit, one full hit: compute = 5·1·2/2·1.8 = 9; io = 2·10·0.4 = 8
    assert m.delay(1, 1, 2) == pytest.approx(9)
    assert m.delay(2, 0, 2) == 0
    H = np.zeros((3, 3))
    H[0, 0], H[1, 1] = 0.25, 0.75
    assert layer_delay(H, m, 2) == pytest.approx(0.25 * 40 + 0.75 * 9)


def test_argmin_rule_is_the_argmin_of_the_delay_model():
    counts = np.array([[[50, 30, 10, 5, 3, 1, 1, 0]] * 4])
    # I/O bound: a full hit saves T·d_sm, an SM hit T·d_sm·(1 - CR) = 0.8·T·d_sm, and two SM
    # slots fit in one full slot's bytes: with p ≈ (1, 0.6, ...) two SM slots save
    # 0.8·1.6 > 1 full hit, so the planner gives the whole layer to the SM tier
    io_bound = DelayModel(tensors=3, threads=2, chunks=5, d_dec=1e-5, d_sm=1e-2, cr=0.2)
    plan = plan_tiers(counts, 2, 8, 2e6, 2_000_000, 1_000_000, io_bound, rule="argmin")
    assert (plan.kind, plan.n_full, plan.n_sm) == ("two_tier", 0, 2)
    # compute bound (slow decode): a full hit is the only saving that matters
    cpu_bound = DelayModel(tensors=3, threads=2, chunks=5, d_dec=1.0, d_sm=1e-4, cr=0.2)
    plan = plan_tiers(counts, 2, 8, 2e6, 2_000_000, 1_000_000, cpu_bound, rule="argmin")
    assert (plan.n_full, plan.n_sm) == (1, 0)
    # brute force over every split of a bigger budget
    pi = inclusion_probabilities(rank_distribution(counts), 2)
    w = cps_weights(pi, 2)
    p = np.minimum(w / (1 + w), 1 - 1e-9)
    plan = plan_tiers(counts, 2, 8, 5e6, 2_000_000, 1_000_000, io_bound, rule="argmin")
    best = min(
        layer_delay(
            hit_distribution(p, int(f * 5e6 // 2e6), min(8, int((1 - f) * 5e6 // 1e6)), 2),
            io_bound,
            2,
        )
        for f in np.arange(0, 101) / 100
    )
    assert plan.expected_delay_s == pytest.approx(best)
    # top-1 models fall back to LFU
    assert plan_tiers(counts, 1, 8, 2e6, 2_000_000, 1_000_000, io_bound).kind == "lfu"


def test_argmin_rule_keeps_a_split_reached_at_one_fraction_only():
    # a budget of exactly two full slots: 2F+0SM exists only at f = 1 (f = 0.98, 0.99 give
    # 1F+0SM); the argmin rule takes it (the authors' rule never examines f = 1)
    counts = np.array([[[50, 30, 10, 5, 3, 1, 1, 0]] * 4])
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    plan = plan_tiers(counts, 2, 8, 4e6, 2_000_000, 1_000_000, m, rule="argmin")
    assert (plan.n_full, plan.n_sm, plan.fraction) == (2, 0, 1.0)
    one_one = [d for f, d in plan.curve if f == 0.6]
    assert plan.expected_delay_s < one_one[0]


def test_centred_rolling_mean_by_hand():
    # window 5, edges average what exists (pandas rolling(5, center=True, min_periods=1))
    got = centred_rolling_mean([1, 2, 3, 4, 5, 6])
    assert got.tolist() == pytest.approx([2, 2.5, 3, 4, 4.5, 5])


COUNTS = np.array([[[50, 30, 10, 5, 3, 1, 1, 0]] * 4])


def test_authors_rule_needs_both_tiers_for_every_expert_over_the_layers():
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    # L = 1: n_full ≥ 8 and n_sm ≥ 8 cannot fit 8 experts, so no fraction is feasible: LFU
    plan = plan_tiers(COUNTS, 2, 8, 4e6, 2_000_000, 1_000_000, m, num_layers=1)
    assert (plan.kind, plan.n_full, plan.n_sm) == ("lfu", 2, 0)
    # L = 4: each tier needs >= 2 slots; 4 MB holds 2F (4 MB, no SM) or 1F+2SM: only
    # n_full >= 2 with n_sm >= 2 passes, which 4 MB cannot hold -> LFU as well
    plan = plan_tiers(COUNTS, 2, 8, 4e6, 2_000_000, 1_000_000, m, num_layers=4)
    assert plan.kind == "lfu"
    # 8 MB, L = 4: every examined split has n_full, n_sm >= 2 and n_full + n_sm <= 8
    plan = plan_tiers(COUNTS, 2, 8, 8e6, 2_000_000, 1_000_000, m, num_layers=4)
    assert plan.kind == "two_tier" and plan.n_full >= 2 and plan.n_sm >= 2
    for f, _ in plan.curve:
        nf, ns = int(f * 8e6 // 2e6), int((1 - f) * 8e6 // 1e6)
        assert nf >= 2 and ns >= 2 and nf + ns <= 8 and 0 < f < 1


def test_authors_rule_is_the_first_minimum_of_the_smoothed_curve_at_int_sum_p():
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    plan = plan_tiers(COUNTS, 2, 8, 8e6, 2_000_000, 1_000_000, m, num_layers=4)
    w = cps_weights(inclusion_probabilities(rank_distribution(COUNTS), 2), 2)
    w = w / w.mean()
    assert plan.k_eff == int(np.minimum(w / (1 + w), 1 - 1e-9).sum())
    fr = [f for f, _ in plan.curve]
    d = [x for _, x in plan.curve]
    smooth = [np.mean(d[max(0, i - 2) : i + 3]) for i in range(len(d))]
    assert plan.fraction == fr[int(np.argmin(smooth))]
    # the unsmoothed delay of the chosen split is reported
    assert plan.expected_delay_s == d[int(np.argmin(smooth))]


def test_authors_rule_returns_f_099_when_no_feasible_fraction_reaches_03():
    # 40 MB of 2 MB full / 1 MB SM slots over 32 experts, L = 4 (each tier >= 8 slots):
    # n_full = ⌊f·20⌋ >= 8 needs f >= 0.4, n_sm = ⌊(1-f)·40⌋ >= 8 needs f <= 0.8, and
    # n_full + n_sm <= 32 needs f >= 0.4: feasible, so the smoothed argmin is used
    counts = np.arange(32, 0, -1)[None, None, :].repeat(4, 1)
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    plan = plan_tiers(counts, 4, 32, 40e6, 2_000_000, 1_000_000, m, num_layers=4)
    assert plan.kind == "two_tier" and 0.4 <= plan.fraction <= 0.8
    # 10 MB, 1 MB full / 7.5 MB SM slots (unphysical, for the test), E = 8, L = 8 (each tier
    # >= 1 slot): n_full >= 1 needs f >= 0.1, n_sm = ⌊(1-f)·10/7.5⌋ >= 1 needs f <= 0.25,
    # so every feasible fraction is below 0.3 and the code's answer is f = 0.99: 8F+0SM
    plan = plan_tiers(COUNTS, 2, 8, 10e6, 1_000_000, 7_500_000, m, num_layers=8)
    assert [f for f, _ in plan.curve] == pytest.approx(np.arange(10, 26) / 100)
    assert (plan.kind, plan.fraction, plan.n_full, plan.n_sm) == ("lfu", 0.99, 8, 0)


def test_unknown_rule_is_refused():
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    with pytest.raises(ValueError, match="rule"):
        plan_tiers(COUNTS, 2, 8, 8e6, 2_000_000, 1_000_000, m, rule="best")
