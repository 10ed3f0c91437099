"""ZipMoE's cache planner: rank distribution, CPS weights, Poisson-binomial hit law, tiers."""

import itertools

import numpy as np
import pytest

from moelab.serve.offload.planner import (
    DelayModel,
    cps_inclusion,
    cps_weights,
    elementary_symmetric,
    hit_distribution,
    hit_distribution_bruteforce,
    inclusion_probabilities,
    layer_delay,
    plan_tiers,
    poisson_binomial,
    rank_distribution,
)


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


def test_plan_is_the_argmin_of_the_delay_model():
    counts = np.array([[[50, 30, 10, 5, 3, 1, 1, 0]] * 4])
    # I/O bound: a full hit saves T·d_sm, an SM hit T·d_sm·(1 - CR) = 0.8·T·d_sm, and two SM
    # slots fit in one full slot's bytes: with p ≈ (1, 0.6, ...) two SM slots save
    # 0.8·1.6 > 1 full hit, so the planner gives the whole layer to the SM tier
    io_bound = DelayModel(tensors=3, threads=2, chunks=5, d_dec=1e-5, d_sm=1e-2, cr=0.2)
    plan = plan_tiers(counts, 2, 8, 2e6, 2_000_000, 1_000_000, io_bound)
    assert (plan.kind, plan.n_full, plan.n_sm) == ("two_tier", 0, 2)
    # compute bound (slow decode): a full hit is the only saving that matters
    cpu_bound = DelayModel(tensors=3, threads=2, chunks=5, d_dec=1.0, d_sm=1e-4, cr=0.2)
    plan = plan_tiers(counts, 2, 8, 2e6, 2_000_000, 1_000_000, cpu_bound)
    assert (plan.n_full, plan.n_sm) == (1, 0)
    # brute force over every split of a bigger budget
    pi = inclusion_probabilities(rank_distribution(counts), 2)
    w = cps_weights(pi, 2)
    p = np.minimum(w / (1 + w), 1 - 1e-9)
    plan = plan_tiers(counts, 2, 8, 5e6, 2_000_000, 1_000_000, io_bound)
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


def test_a_split_reached_at_one_fraction_only_is_not_lost():
    # a budget of exactly two full slots: 2F+0SM exists only at f = 1 (f = 0.98, 0.99 give
    # 1F+0SM). A window-5 smoothing of the curve (the authors' code) picked the 1F+1SM
    # plateau here; the plan is the split with the least expected delay
    counts = np.array([[[50, 30, 10, 5, 3, 1, 1, 0]] * 4])
    m = DelayModel(tensors=2, threads=2, chunks=5, d_dec=6e-4, d_sm=4.4e-3, cr=0.37)
    plan = plan_tiers(counts, 2, 8, 4e6, 2_000_000, 1_000_000, m)
    assert (plan.n_full, plan.n_sm, plan.fraction) == (2, 0, 1.0)
    one_one = [d for f, d in plan.curve if f == 0.6]
    assert plan.expected_delay_s < one_one[0]
