"""Work rank 0 does alone while the other ranks wait for it: under data parallelism the
validation, the checkpoints and the final model; the ``on_step`` probe.

Waiting for it in one collective (a barrier) would count against the process-group timeout,
which would then have to exceed the longest validation. Instead a heartbeat thread on rank 0
meets the other ranks in a small all-reduce every second while rank 0 works (on a gloo group of
its own, so that it never mixes with the training's collectives), and once more with the
outcome. The others go round with it: they wait as long as the rounds go on, so a long
validation never times out, while a rank 0 that is stopped or gone (its thread stops with it)
ends the round in progress at the timeout. A failure on rank 0 reaches the others at once.

The rounds are collectives rather than a heartbeat in the process group's key-value store:
where rank 0 serves that store (``env://`` without torchrun's agent), a stopped rank 0 freezes
it, and a store call then waits forever whatever its timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from moelab.errors import DistributedTimeoutError, UserError
from moelab.train.distributed import DistInfo
from moelab.train.stopping import note_progress, polling

T = TypeVar("T")
BEAT_S = 1.0
_WORKING, _DONE, _FAILED = 0, 1, 2


class MainRankFailedError(UserError, RuntimeError):
    """Rank 0 failed in work the other ranks waited for; rank 0 reports why, so the other
    ranks print nothing (the CLI prints user errors on rank 0 only) and exit."""


class MainRankWork:
    """Runs work on rank 0 while the other ranks wait. Create it on every rank at the same
    point (it makes a process group), and call :meth:`run` on every rank in the same order.

    Args:
        info: this rank's place; ``info.timeout_s`` limits each round, so a silent rank 0 is
            waited for that long.
    """

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self._group = dist.new_group(backend="gloo", timeout=info.timeout) if info.enabled else None
        self._beat_s = min(BEAT_S, info.timeout_s / 4)

    def run(self, fn: Callable[[], T], what: str) -> T | None:
        """``fn()`` on rank 0, returning its result there and None elsewhere once rank 0 is done
        (``fn()`` itself when not distributed).

        Args:
            what: the work, for messages ("validating", ...).
        Raises:
            DistributedTimeoutError: a round got no answer within the timeout (on rank 0,
                raised once ``fn`` is done).
            MainRankFailedError: (ranks > 0) ``fn`` raised on rank 0.
        """
        if self._group is None:
            return fn()
        if self.info.is_main:
            return self._work(fn, what)
        self._wait(what)
        return None

    def _round(self, state: int) -> int:
        """One all-reduce (max) of the ranks' states (gloo raises RuntimeError at the timeout)."""
        flag = torch.tensor([state])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def _work(self, fn: Callable[[], T], what: str) -> T:
        done, outcome, lost = threading.Event(), [_FAILED], []

        def beat() -> None:
            try:
                while not done.wait(self._beat_s):
                    self._round(_WORKING)
                self._round(outcome[0])
            except RuntimeError as e:  # another rank is silent: reported once fn is done
                lost.append(e)

        thread = threading.Thread(target=beat, name="moelab-rank0-heartbeat", daemon=True)
        thread.start()
        try:
            result = fn()
            outcome[0] = _DONE
        finally:
            done.set()
            thread.join()
        if lost:
            raise self._silent(what) from lost[0]
        return result

    def _wait(self, what: str) -> None:
        with polling():
            try:
                while (state := self._round(_WORKING)) == _WORKING:
                    note_progress()
            except RuntimeError as e:
                raise self._silent(what) from e
        if state == _FAILED:
            raise MainRankFailedError(f"rank {self.info.rank}: rank 0 failed while {what}")

    def _silent(self, what: str) -> DistributedTimeoutError:
        return DistributedTimeoutError(
            f"rank {self.info.rank}: no answer for {self.info.timeout_s:g} s while rank 0 was "
            f"{what} (a rank is stopped, hung or gone); stopped here, the last checkpoint "
            "stays valid (--dist-timeout sets the limit)"
        )
