"""The priority pool: most urgent first, FIFO within a priority, promotion and cancellation."""

import threading

import pytest

from moelab.serve.offload.pool import DEMAND, PREFETCH, Entry, PriorityPool


def blocked_pool():
    """A one-worker pool whose worker is held inside a first call until ``release.set()``."""
    pool = PriorityPool(1, "test")
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(5)

    pool.submit(DEMAND, Entry(hold))
    assert started.wait(5)
    return pool, release


def drain(pool):
    done = threading.Event()
    pool.submit(PREFETCH + 1, Entry(done.set))
    assert done.wait(5)
    pool.shutdown()


def test_demand_before_prefetch_fifo_within_a_priority():
    pool, release = blocked_pool()
    ran = []
    for name, prio in (("p1", PREFETCH), ("d1", DEMAND), ("p2", PREFETCH), ("d2", DEMAND)):
        pool.submit(prio, Entry(ran.append, name))
    release.set()
    drain(pool)
    assert ran == ["d1", "d2", "p1", "p2"]


def test_promoted_entry_runs_once_and_early_and_cancelled_never():
    pool, release = blocked_pool()
    ran = []
    p1, p2, p3 = (pool.submit(PREFETCH, Entry(ran.append, n)) for n in ("p1", "p2", "p3"))
    pool.submit(DEMAND, Entry(ran.append, "d"))
    pool.submit(DEMAND, p3)  # promoted: queued again at demand priority
    assert p2.claim()  # cancelled: whoever claims first decides
    release.set()
    drain(pool)
    assert ran == ["d", "p3", "p1"]
    assert not p3.claim() and not p1.claim()


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        PriorityPool(0, "x")
