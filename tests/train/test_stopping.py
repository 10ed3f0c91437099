"""The stop watcher (:mod:`moelab.train.stopping`) on real processes: after SIGTERM, a main
thread stuck in one call exits ``grace`` seconds later with 143 and one line; one that keeps
running Python stops cleanly however long it takes; while polling for another rank only that
rank's heartbeat counts; the stop flag agreed over the ranks keeps a signal that lands while
the agreement is under way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moelab
from moelab.errors import InvalidValueError
from moelab.train.loop_session import TrainSession
from moelab.train.stopping import StopFlag, check_stop_grace

SRC = str(Path(moelab.__file__).resolve().parents[1])
SCRIPT = """
import contextlib, sys, time
from moelab.train.stopping import StopFlag, note_progress, polling

mode, grace = sys.argv[1], float(sys.argv[2])
with StopFlag(grace_s=grace, rank=3) as flag:
    print("ready", flush=True)
    if mode == "blocked":
        time.sleep(60)  # one call: the SIGTERM handler runs, the pings after it are not answered
    else:
        while not flag.stop:
            time.sleep(0.01)
        end = time.monotonic() + 3 * grace  # a stop that takes 3 graces
        with polling() if mode.startswith("polling") else contextlib.nullcontext():
            while time.monotonic() < end:
                sum(range(1000))
                if mode == "polling-heartbeat":
                    note_progress()
print("stopped cleanly", flag.stop, flush=True)
"""
GRACE = 1.0


MODES = ("blocked", "moving", "polling", "polling-heartbeat")


@pytest.fixture(scope="module")
def stopped() -> dict[str, tuple[int, float, str, str]]:
    """SCRIPT in every mode at once (they take seconds each), SIGTERMed once ready:
    ``{mode: (exit code, seconds from the signal to the exit, stdout, stderr)}``."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, mode, str(GRACE)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in MODES
    }
    results = {}
    try:
        signalled = {}
        for mode, proc in procs.items():
            assert proc.stdout.readline() == "ready\n", proc.communicate()
            proc.send_signal(signal.SIGTERM)
            signalled[mode] = time.monotonic()
        exited, end = {}, time.monotonic() + 30
        while len(exited) < len(procs) and time.monotonic() < end:
            for mode, proc in procs.items():
                if mode not in exited and proc.poll() is not None:
                    exited[mode] = time.monotonic()
            time.sleep(0.02)
        for mode, proc in procs.items():
            waited = exited[mode] - signalled[mode]
            results[mode] = (proc.returncode, waited, proc.stdout.read(), proc.stderr.read())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


MESSAGE = (
    "moelab: rank 3: still blocked 1 s after SIGTERM (in a collective: is another rank "
    "stopped or gone?); exiting without a new checkpoint, the last one stays valid\n"
)


def test_a_blocked_main_thread_exits_after_the_grace(stopped):
    code, waited, out, err = stopped["blocked"]
    assert (code, out, err) == (143, "", MESSAGE)
    assert GRACE <= waited < GRACE + 3


def test_a_main_thread_that_runs_python_stops_cleanly_however_long_it_takes(stopped):
    code, waited, out, err = stopped["moving"]
    assert (code, out, err) == (0, "stopped cleanly True\n", "")
    assert waited >= 3 * GRACE


def test_while_polling_only_the_heartbeat_counts(stopped):
    code, waited, out, err = stopped["polling"]  # the loop runs, but nothing it waits for
    assert (code, out, err) == (143, "", MESSAGE)
    assert GRACE <= waited < GRACE + 3
    code, waited, out, err = stopped["polling-heartbeat"]
    assert (code, out, err) == (0, "stopped cleanly True\n", "")
    assert waited >= 3 * GRACE


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_check_stop_grace_refuses_what_is_not_a_finite_positive_number(bad):
    with pytest.raises(InvalidValueError, match="stop_grace_s: must be a finite number"):
        check_stop_grace(bad)
    assert check_stop_grace(2) == 2.0


def _session(peer_flags: list[bool], monkeypatch, signalled: bool) -> TrainSession:
    """A two-rank session's stop check with a fake all-reduce: each call takes the peer's
    flag from ``peer_flags``; with ``signalled`` the first call also delivers this rank's
    signal while it is blocked (its handler runs after the flag was read, as CPython runs
    handlers)."""
    session = object.__new__(TrainSession)
    session.dist_info = type("Dist", (), {"enabled": True})()
    session.device, session.stop = torch.device("cpu"), StopFlag()
    calls = []

    def all_reduce(tensor, op):
        if signalled and not calls:
            session.stop.stop = True  # SIGTERM's handler, after the tensor was built
        tensor.copy_(torch.maximum(tensor, torch.tensor([int(peer_flags[len(calls)])])))
        calls.append(int(tensor.item()))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return session


def test_a_signal_during_the_agreement_stops_at_the_next_check(monkeypatch):
    session = _session([False, False], monkeypatch, signalled=True)
    assert session.stop_requested() is False  # both ranks offered 0 to this all-reduce
    assert session.stop.stop is True  # ... but the signal is kept, not overwritten
    assert session.stop_requested() is True


def test_the_peers_signal_stops_this_rank_too(monkeypatch):
    session = _session([False, True, False], monkeypatch, signalled=False)
    assert session.stop_requested() is False
    assert session.stop.stop is False
    assert session.stop_requested() is True
    assert session.stop.stop is True
    assert session.any_rank(False) is False  # a flag no rank raised stays down
