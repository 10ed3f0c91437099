"""Eviction policies and ZipMoE's two-tier admission on hand-built traces."""

import random

import pytest

from moelab.serve.offload.policies import POLICIES, simulate
from moelab.serve.offload.tiers import TwoTierCache

T, F = True, False
TRACE = [1, 2, 1, 3, 2, 4, 1, 2]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # LRU: 3 evicts 2 (1 was used last), 2 evicts 1, 4 evicts 3, 1 evicts 2, 2 evicts 4
        ("lru", [F, F, T, F, F, F, F, F]),
        # FIFO: 3 evicts 1 (oldest insert), 2 hits, 4 evicts 2, 1 evicts 3, 2 evicts 4
        ("fifo", [F, F, T, F, T, F, F, F]),
        # LFU: 1 reaches count 2; 3, 2, 4 each evict the count-1 newcomer; 1 hits; 2 evicts 4
        ("lfu", [F, F, T, F, F, F, T, F]),
        # token-LFU with unit tokens behaves like LFU here
        ("zipmoe", [F, F, T, F, F, F, T, F]),
        # MIN with bypass: 3 and 4 are never requested again, so they bypass the cache
        ("belady", [F, F, T, F, T, F, T, T]),
    ],
)
def test_hand_computed_hits(policy, expected):
    assert simulate(policy, TRACE, capacity=2) == expected


def test_token_weighting_changes_the_victim():
    trace, tokens = [1, 2, 1, 2, 3, 1], [1, 1, 4, 1, 1, 1]
    # LFU counts accesses: 1 and 2 both have 2, LRU tie-break evicts 1 when 3 arrives
    assert simulate("lfu", trace, 2, tokens) == [F, F, T, T, F, F]
    # token-LFU: 1 has 1 + 4 = 5, 2 has 1 + 1 = 2, so 3 evicts 2 and 1 hits
    assert simulate("zipmoe", trace, 2, tokens) == [F, F, T, T, F, T]


def test_capacity_zero_and_bad_policy():
    assert simulate("lru", [1, 1, 1], 0) == [F, F, F]
    with pytest.raises(ValueError, match="policy"):
        simulate("arc", [1], 1)
    with pytest.raises(ValueError, match="tokens"):
        simulate("lru", [1, 2], 1, [1])


def test_belady_is_never_worse():
    rng = random.Random(0)
    for _ in range(150):
        n_keys = rng.randint(2, 7)
        weights = [rng.random() ** 2 for _ in range(n_keys)]
        trace = rng.choices(range(n_keys), weights=weights, k=rng.randint(1, 40))
        tokens = [rng.randint(1, 5) for _ in trace]
        cap = rng.randint(0, n_keys)
        best = sum(simulate("belady", trace, cap, tokens))
        for p in POLICIES:
            assert sum(simulate(p, trace, cap, tokens)) <= best, (p, trace, cap)


def test_authors_admission_by_hand():
    # ProactiveDecision; 1 full + 1 SM slot, E = 4: T_full = 1.4, T_sm = 2.8
    c = TwoTierCache(1, 1, 4)
    steps = [
        # (expert, tokens) -> (before, after, evicted); g = global token counts after it
        ((0, 3), ("miss", "full", [])),  # g = [3,0,0,0]; up 0 < 1.4, full slot free
        ((1, 1), ("miss", "sm", [])),  # g = [3,1,0,0]; up 1 < 1.4: full taken, SM free
        # g = [3,1,2,0]; up 1 < 1.4, nothing free: full, evicting its LFU minimum (0)
        ((2, 2), ("miss", "full", [(0, "full")])),
        ((3, 4), ("miss", "full", [(2, "full")])),  # g = [3,1,2,4]; up 0
        ((0, 1), ("miss", "full", [(3, "full")])),  # g = [4,1,2,4]; up 0
        # g = [4,2,2,4]: SM resident 1 has up 2 in [1.4, 2.8) -> SM: it stays (an SM hit)
        ((1, 1), ("sm", "sm", [])),
        # g = [4,2,3,4]: up(2) = 2 -> SM, nothing free -> SM, evicting 1
        ((2, 1), ("miss", "sm", [(1, "sm")])),
        ((1, 1), ("miss", "sm", [(2, "sm")])),  # g = [4,3,3,4]: up(1) = 2, evicting 2
        # g = [4,13,3,4]: SM resident 1 has up 0 -> full, evicting 0; its SM slot is freed
        ((1, 10), ("sm", "full", [(0, "full")])),
    ]
    for (e, tok), (before, after, evicted) in steps:
        acc = c.access(e, tok)
        assert (acc.before, acc.after, acc.evicted) == (before, after, evicted), (e, tok)
    assert c.full == {1} and c.sm == set()
    # cold experts (up >= T_sm) are cached only in a free slot: margin 0, T_full 1, T_sm 2
    c2 = TwoTierCache(1, 1, 8, margin=0)
    assert c2.access(0, 10).after == "full"
    assert c2.access(1, 9).after == "sm"  # up 1 in [1, 2): SM, free
    acc = c2.access(2, 8)  # up 2 >= 2, no free slot: not cached, nothing evicted
    assert (acc.before, acc.after, acc.evicted) == ("miss", None, [])
    with pytest.raises(ValueError, match="admission"):
        TwoTierCache(1, 1, 4, admission="lru")


def test_hysteresis_admission_by_hand():
    # 1 full + 1 SM slot, E = 4: T_full = 1 + 0.4 = 1.4, T_sm = 1.4 + 1 + 0.4 = 2.8
    c = TwoTierCache(1, 1, 4, admission="hysteresis")
    steps = [
        # (expert, tokens) -> (before, after, evicted)
        ((0, 3), ("miss", "full", [])),  # g = [3,0,0,0]; up 0 < 1.4, full slot free
        ((1, 1), ("miss", "sm", [])),  # up 1 < 1.4 but 0 (up 0) is hot: falls to SM
        ((2, 1), ("miss", None, [])),  # up 1: full holds hot 0, SM holds 1 with up 1 < 2.8
    ]
    for (e, tok), (before, after, evicted) in steps:
        acc = c.access(e, tok)
        assert (acc.before, acc.after, acc.evicted) == (before, after, evicted), e
    # g = [3,6,1,0]: rank(1) = 0 → wants full; resident 0 has rank 1 < 1.4 (still hot), so
    # 1 stays in its SM slot (an SM hit)
    acc = c.access(1, 5)
    assert (acc.before, acc.after, acc.evicted) == ("sm", "sm", [])
    # 0 gets one more token (g = [4,6,1,0], unchanged ranks); full hit
    assert c.access(0, 1).before == "full"
    # 3 arrives with 9 tokens: g = [4,6,1,9]; rank(3) = 0; full resident 0 has rank 2 >= 1.4
    # (cold) and is evicted; 3 goes to full
    acc = c.access(3, 9)
    assert (acc.before, acc.after, acc.evicted) == ("miss", "full", [(0, "full")])
    # 0 again: rank 2 >= 1.4 → SM preferred; SM resident 1 has rank 1 < 2.8 (hot): no room
    acc = c.access(0, 1)
    assert (acc.before, acc.after) == ("miss", None)
    assert c.full == {3} and c.sm == {1}
