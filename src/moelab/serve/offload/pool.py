"""A thread pool that runs the most urgent queued call first: demand loads (priority 0) before
prefetches (1), first come first served within a priority. ``concurrent.futures`` pools are
FIFO only, and a queued prefetch must neither delay a load the forward pass waits for nor run
after its layer has passed, so entries can be promoted and cancelled while queued.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any

from moelab.errors import InvalidValueError

DEMAND, PREFETCH = 0, 1


class Entry:
    """One queued call; it runs at most once, whichever of its queue slots is popped first."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """True the first time (the caller runs or drops it), False after."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True


class PriorityPool:
    """``workers`` daemon threads over one priority queue.

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise InvalidValueError(f"workers: must be >= 1, got {workers}")
        self._heap: list[tuple[int, int, Entry]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, entry: Entry) -> Entry:
        """Queue ``entry`` at ``priority`` (lower runs first); queuing it again at a lower
        priority promotes it."""
        with self._cv:
            heapq.heappush(self._heap, (priority, next(self._seq), entry))
            self._cv.notify()
        return entry

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                _, _, entry = heapq.heappop(self._heap)
            if entry.claim():
                entry.fn(*entry.args)

    def shutdown(self) -> None:
        """Stop the workers after their current call; queued calls are dropped."""
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
