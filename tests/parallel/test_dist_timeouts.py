"""Distributed waits with a timeout (spawned gloo ranks): rank 0's work alone is waited for as
long as rank 0 is alive and no longer; collectives of expert-parallel subgroups end at the
timeout given to :func:`moelab.parallel.comm.build_groups`."""

from __future__ import annotations

import pytest
from fault_workers import ep_subgroup_times_out, main_rank_waits

from moelab.errors import DistributedTimeoutError
from moelab.parallel.launch import spawn_ranks
from moelab.train.distributed import DistInfo, check_dist_timeout, timeout_error

pytestmark = pytest.mark.slow
TIMEOUT = 1.5


def test_rank_0_alone_is_waited_for_while_alive_and_its_fate_passed_on():
    main, *others = spawn_ranks(main_rank_waits, 2, timeout=120, timeout_s=TIMEOUT)
    # 3 timeouts of work: waited for, not timed out. The others start their clocks a little
    # after rank 0 starts sleeping, so the bound is 2 timeouts: well past the limit, with the
    # ranks' start skew allowed for
    assert main["slow"][0] == "'slow done'"
    for rank, other in enumerate(others, 1):
        assert other["slow"][0] == "None" and other["slow"][1] >= 2 * TIMEOUT
        # a failure on rank 0 reaches the others at once
        assert other["failing"][0] == (
            f"MainRankFailedError: rank {rank}: rank 0 failed while dividing"
        )
        assert other["failing"][1] < 2.0
        # a frozen rank 0 is given up on after the timeout
        assert other["frozen"][0] == (
            f"DistributedTimeoutError: rank {rank}: no answer for 1.5 s while rank 0 was "
            "freezing (a rank is stopped, hung or gone); stopped here, the last checkpoint "
            "stays valid (--dist-timeout sets the limit)"
        )
        assert TIMEOUT <= other["frozen"][1] < TIMEOUT + 5
    assert main["failing"][0] == "ZeroDivisionError: division by zero"
    # continued, rank 0 finds the others gone from its heartbeat's round
    assert main["frozen"][0].startswith(
        "DistributedTimeoutError: rank 0: no answer for 1.5 s while rank 0 was freezing"
    )


def test_an_expert_parallel_subgroup_times_out_at_the_given_timeout():
    results = spawn_ranks(ep_subgroup_times_out, 4, timeout=120, timeout_s=TIMEOUT)
    assert results[0] == results[1] == 2.0  # the group {0, 1} is whole
    timed_out, waited = results[2]  # torch's default would wait 30 minutes
    assert timed_out and TIMEOUT * 0.9 <= waited < TIMEOUT + 5


def test_timeout_checks_and_message():
    for bad in (0, -1, float("nan"), float("inf"), 10**9, True, "600"):
        with pytest.raises(ValueError, match="dist_timeout_s: must be a number of seconds"):
            check_dist_timeout(bad)
    info = DistInfo(rank=1, world_size=2, timeout_s=10)
    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
    )
    err = timeout_error(gloo, info)
    assert isinstance(err, DistributedTimeoutError) and str(err).startswith(
        "rank 1: another rank did not answer for 10 s"
    )
    assert timeout_error(RuntimeError("shape mismatch"), info) is None
    assert timeout_error(gloo, DistInfo()) is None  # not distributed: not ours to rename
