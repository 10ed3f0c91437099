"""Stopping a training run on SIGINT/SIGTERM, also when a rank is blocked in a collective.

The handlers set a flag that the loop checks before every micro-batch: it then abandons the
step, checkpoints the last finished one and exits. A second signal aborts at once.

A Python signal handler runs only when the main thread is back in the interpreter. A rank of a
distributed run that is blocked in a collective (a peer stopped or gone) stays inside one C++
call until the process-group timeout, so it ignored SIGTERM for that long. In distributed runs
(``grace_s`` given) a watcher thread therefore learns of the signal from
:func:`signal.set_wakeup_fd` (the C-level handler writes the signal's number there whatever
the main thread is doing), and from then on asks the main thread for a sign of life ten times
a second: :func:`_thread.interrupt_main` with a ping signal (``SIGWINCH``, whose default action
is to do nothing) whose handler only counts. The handler runs as soon as the main thread
executes Python again, so a rank that is computing or writing its checkpoint answers at once,
however long its stop takes; while the main thread polls for another rank
(:func:`polling`), only that rank's heartbeat counts (:func:`note_progress`,
:mod:`moelab.train.main_rank`). After ``grace_s`` seconds without an answer the rank is stuck:
the watcher prints one line and ends the process with ``os._exit(128 + signal)`` (143 for
SIGTERM, 130 for SIGINT); torchrun sees the rank fail and tears the job down. Files are safe
either way: every write is atomic, so a checkpoint being written when the process ends is never
accepted half-written and the previous one stays valid.

A single C call longer than the grace (a multi-GB weights write that holds the main thread)
also ends the process; the default, 30 s, is the usual time a launcher grants between SIGTERM
and SIGKILL (torchrun, Slurm's ``KillWait``, Kubernetes), so such a stop could not have
finished anyway.
"""

from __future__ import annotations

import _thread
import contextlib
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from moelab.errors import InvalidValueError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_STOP_GRACE_S = 30.0
_SAMPLE_S = 0.1
_QUIT = b"\0"  # no signal has number 0: what ends the watcher when the run ends
_PING = getattr(signal, "SIGWINCH", None)  # POSIX only: elsewhere there is no watcher

_progress = 0
_polling = False


@contextlib.contextmanager
def polling():
    """For the block, the main thread waits for another rank in a Python loop, which moves
    without making progress: the watcher counts only :func:`note_progress` calls then."""
    global _polling
    _polling = True
    try:
        yield
    finally:
        _polling = False


def note_progress() -> None:
    """Tell the stop watcher that the rank the main thread waits for is alive and working."""
    global _progress
    _progress += 1


def check_stop_grace(seconds: float) -> float:
    """``seconds`` as a float when it is a finite number > 0.

    Raises:
        InvalidValueError: otherwise, naming ``stop_grace_s``.
    """
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not (math.isfinite(seconds) and seconds > 0)
    ):
        raise InvalidValueError(
            f"stop_grace_s: must be a finite number of seconds > 0, got {seconds!r}"
        )
    return float(seconds)


class StopFlag:
    """SIGINT/SIGTERM set :attr:`stop`; a second one raises ``KeyboardInterrupt``.

    Args:
        grace_s: watch for a main thread stuck after the signal and end the process after
            this many seconds without progress (distributed runs); None: no watcher.
        rank: named in the watcher's message.
    """

    def __init__(self, grace_s: float | None = None, rank: int = 0) -> None:
        self.stop = False
        self.grace_s = grace_s
        self.rank = rank
        self._previous: dict[int, Any] = {}
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        self._pongs = 0

    def __enter__(self) -> StopFlag:
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        if self.grace_s is not None and self._previous and _PING is not None:
            self._previous[_PING] = signal.signal(_PING, self._pong)
            self._read, self._write = os.pipe()
            os.set_blocking(self._write, False)  # set_wakeup_fd requires it
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            self._watcher = threading.Thread(
                target=self._watch, name="moelab-stop-watcher", daemon=True
            )
            self._watcher.start()
        return self

    def _pong(self, signum, frame) -> None:
        self._pongs += 1

    def _handle(self, signum, frame) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def __exit__(self, *exc) -> None:
        if self._watcher is not None:  # stopped first: no ping may reach a restored handler
            self._closed.set()
            os.write(self._write, _QUIT)
            self._watcher.join()
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._read)
            os.close(self._write)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _watch(self) -> None:
        signum = self._next_stop_signal()
        if signum is None:
            return
        last, since = None, time.monotonic()
        while not self._closed.wait(_SAMPLE_S):
            now = (_progress, None if _polling else self._pongs)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= self.grace_s:
                sys.stderr.write(
                    f"moelab: rank {self.rank}: still blocked {self.grace_s:g} s after "
                    f"{signal.Signals(signum).name} (in a collective: is another rank stopped "
                    "or gone?); exiting without a new checkpoint, the last one stays valid\n"
                )
                sys.stderr.flush()
                os._exit(128 + signum)
            _thread.interrupt_main(_PING)  # the main thread answers when it runs Python

    def _next_stop_signal(self) -> int | None:
        """Block until a stop signal's number arrives on the wakeup pipe (None: the run
        ended first). Other handled signals' numbers (the ping's) are skipped."""
        while True:
            data = os.read(self._read, 512)
            for number in data:
                if number == _QUIT[0]:
                    return None
                if number in STOP_SIGNALS:
                    return number
