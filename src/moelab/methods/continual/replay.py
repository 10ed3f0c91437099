"""A per-class reservoir of training examples for replay-based continual learners.

Named ``ClassReservoir`` so it is not confused with router replay
(:mod:`moelab.core.replay`). Each class keeps at most ``per_class`` items chosen by reservoir
sampling (Vitter's algorithm R, ACM TOMS 1985): the ``n``-th item of a class replaces a random
kept one with probability ``per_class / n``, so every item seen has the same chance to be kept.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable

from moelab.errors import InvalidValueError


class ClassReservoir:
    """At most ``per_class`` items per class, uniformly sampled from everything added.

    Args:
        per_class: capacity per class (>= 1).
        seed: seed of the sampling.
    """

    def __init__(self, per_class: int, seed: int = 0) -> None:
        if not isinstance(per_class, int) or isinstance(per_class, bool) or per_class < 1:
            raise InvalidValueError(f"per_class: must be an int >= 1, got {per_class!r}")
        self.per_class = per_class
        self._rng = random.Random(seed)
        self._items: dict[Hashable, list] = {}
        self._seen: dict[Hashable, int] = {}

    def add(self, items: Iterable, labels: Iterable[Hashable]) -> None:
        """Offer each item under its label (algorithm R per class)."""
        for item, y in zip(items, labels, strict=True):
            kept = self._items.setdefault(y, [])
            n = self._seen.get(y, 0) + 1
            self._seen[y] = n
            if len(kept) < self.per_class:
                kept.append(item)
            else:
                j = self._rng.randrange(n)
                if j < self.per_class:
                    kept[j] = item

    def classes(self) -> list[Hashable]:
        return list(self._items)

    def items(self, label: Hashable) -> list:
        """The kept items of ``label`` (empty for an unseen label)."""
        return list(self._items.get(label, []))

    def sample(self, n: int) -> list[tuple]:
        """``n`` ``(item, label)`` pairs drawn uniformly with replacement from all kept ones.

        Raises:
            InvalidValueError: ``n < 0``, or ``n > 0`` with an empty reservoir.
        """
        if n < 0:
            raise InvalidValueError(f"n: must be >= 0, got {n}")
        pool = [(item, y) for y, kept in self._items.items() for item in kept]
        if n and not pool:
            raise InvalidValueError("the reservoir is empty")
        return [pool[self._rng.randrange(len(pool))] for _ in range(n)]

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())
