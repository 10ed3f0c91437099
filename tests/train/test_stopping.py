"""The stop watcher (:mod:`moelab.train.stopping`) on real processes: after SIGTERM, a main
thread stuck in one call exits ``grace`` seconds later with 143 and one line; one that keeps
running Python stops cleanly however long it takes; while polling for another rank only that
rank's heartbeat counts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moelab
from moelab.errors import InvalidValueError
from moelab.train.stopping import check_stop_grace

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
