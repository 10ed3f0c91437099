"""Cache eviction policies for offloaded experts, and a trace simulator.

A cache holds at most ``capacity`` keys (one key = one expert of one layer). Requests arrive
one key at a time with a token count (how many tokens of the current step route to that
expert). :meth:`SlotCache.access` reports whether the request hit, and keeps or evicts keys
according to its policy:

- ``lru``: evict the least recently used key.
- ``lfu``: evict the key with the fewest accesses since it was inserted (count 1 on insert,
  +1 per hit); ties go to the least recently used.
- ``fifo``: evict the oldest inserted key.
- ``zipmoe``: ZipMoE's token-weighted LFU (the authors' ``csrc/memory/cache.cpp``): count 1 on
  insert, ``+num_tokens`` per hit, reset on eviction, evict the minimum; ties go to the least
  recently used (our choice; the code's tie order is not documented).
- ``belady``: Belady's MIN on a known future request sequence: evict the resident key whose next
  request is farthest away, and *bypass* (do not insert) the requested key when its own next
  request is farther than every resident's. With bypass allowed this is the optimal policy
  for the sequential request model, so no policy — including those that bypass — gets more
  hits on the same sequence.

Every policy except ``belady`` always inserts a missed key (evicting a victim when full).
ZipMoE's admission thresholds live in :mod:`moelab.serve.offload.tiers` on top of these.

Requests inside one decode step are processed in ascending expert order; a key evicted
mid-step remains usable for that step (the dispatcher holds a working copy), so capacity
bounds only what stays cached between requests.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from moelab.errors import InvalidValueError

POLICIES = ("lru", "lfu", "fifo", "zipmoe", "belady")


class EvictionPolicy:
    """Bookkeeping shared by the policies: per-key counters updated on hit/insert/evict."""

    def __init__(self) -> None:
        self.clock = 0
        self.last_use: dict[Hashable, int] = {}
        self.inserted_at: dict[Hashable, int] = {}
        self.count: dict[Hashable, float] = {}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def on_hit(self, key: Hashable, tokens: int) -> None:
        self.last_use[key] = self.tick()
        self.count[key] = self.count.get(key, 0) + 1

    def on_insert(self, key: Hashable, tokens: int) -> None:
        t = self.tick()
        self.last_use[key] = t
        self.inserted_at[key] = t
        self.count[key] = 1

    def on_evict(self, key: Hashable) -> None:
        self.last_use.pop(key, None)
        self.inserted_at.pop(key, None)
        self.count[key] = 0

    def victim(self, resident: Iterable[Hashable]) -> Hashable:
        """The key to evict among ``resident`` (non-empty)."""
        raise NotImplementedError

    def bypass(self, key: Hashable, resident: Iterable[Hashable]) -> bool:
        """True to serve ``key`` without caching it instead of evicting (only Belady)."""
        return False

    def observe(self, key: Hashable) -> None:
        """Called for every request, hit or miss, before anything else."""


class LRU(EvictionPolicy):
    def victim(self, resident):
        return min(resident, key=lambda k: self.last_use[k])


class LFU(EvictionPolicy):
    def victim(self, resident):
        return min(resident, key=lambda k: (self.count[k], self.last_use[k]))


class FIFO(EvictionPolicy):
    def victim(self, resident):
        return min(resident, key=lambda k: self.inserted_at[k])


class TokenLFU(EvictionPolicy):
    """ZipMoE's token-weighted LFU: ``+tokens`` per hit, 1 on insert, 0 after eviction."""

    def on_hit(self, key, tokens):
        self.last_use[key] = self.tick()
        self.count[key] = self.count.get(key, 0) + tokens

    def victim(self, resident):
        return min(resident, key=lambda k: (self.count[k], self.last_use[k]))


class Belady(EvictionPolicy):
    """MIN with bypass on the known request sequence ``future`` (keys in request order).

    Raises:
        ValueError: a request differs from the recorded sequence (the trace does not match).
    """

    def __init__(self, future: Sequence[Hashable]) -> None:
        super().__init__()
        self.future = list(future)
        self.pos = -1  # index of the current request in ``future``
        self._next: list[int] = [0] * len(self.future)
        upcoming: dict[Hashable, int] = {}
        for i in range(len(self.future) - 1, -1, -1):
            self._next[i] = upcoming.get(self.future[i], math.inf)  # type: ignore[arg-type]
            upcoming[self.future[i]] = i
        self._next_of: dict[Hashable, float] = {}

    def observe(self, key):
        self.pos += 1
        if self.pos >= len(self.future) or self.future[self.pos] != key:
            raise InvalidValueError(
                f"belady: request {self.pos} is {key!r}, the recorded trace says "
                f"{self.future[self.pos] if self.pos < len(self.future) else 'end of trace'!r}"
            )
        self._next_of[key] = self._next[self.pos]

    def _next_use(self, key) -> float:
        return self._next_of.get(key, math.inf)

    def victim(self, resident):
        return max(resident, key=lambda k: (self._next_use(k), repr(k)))

    def bypass(self, key, resident):
        return self._next_use(key) >= max(self._next_use(k) for k in resident)


def build_policy(name: str, future: Sequence[Hashable] | None = None) -> EvictionPolicy:
    """A fresh policy by name (``belady`` needs the recorded request sequence ``future``).

    Raises:
        ValueError: unknown name, or ``belady`` without ``future``.
    """
    if name == "belady":
        if future is None:
            raise InvalidValueError("policy belady: needs the recorded request trace (future)")
        return Belady(future)
    table = {"lru": LRU, "lfu": LFU, "fifo": FIFO, "zipmoe": TokenLFU}
    if name not in table:
        raise InvalidValueError(f"policy: must be one of {', '.join(POLICIES)}; got {name!r}")
    return table[name]()


@dataclass
class Access:
    """Result of one request: ``hit``; ``cached`` (resident afterwards); ``evicted`` key."""

    hit: bool
    cached: bool
    evicted: Hashable | None = None


@dataclass
class SlotCache:
    """``capacity`` slots managed by ``policy`` (``capacity`` may be 0: nothing is cached)."""

    capacity: int
    policy: EvictionPolicy
    resident: set = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise InvalidValueError(f"capacity: must be >= 0, got {self.capacity}")

    def access(self, key: Hashable, tokens: int = 1) -> Access:
        """Request ``key`` on behalf of ``tokens`` tokens."""
        p = self.policy
        p.observe(key)
        if key in self.resident:
            p.on_hit(key, tokens)
            return Access(True, True)
        if self.capacity == 0:
            return Access(False, False)
        evicted = None
        if len(self.resident) >= self.capacity:
            if p.bypass(key, self.resident):
                return Access(False, False)
            evicted = p.victim(self.resident)
            self.resident.discard(evicted)
            p.on_evict(evicted)
        self.resident.add(key)
        p.on_insert(key, tokens)
        return Access(False, True, evicted)


def simulate(
    policy: str, requests: Sequence[Hashable], capacity: int, tokens: Sequence[int] | None = None
) -> list[bool]:
    """Hit (True) or miss of every request of a single-tier cache.

    Args:
        policy: a name in :data:`POLICIES`.
        requests: keys in request order.
        capacity: slots.
        tokens: tokens per request (default 1 each; only ``zipmoe`` weighs by them).
    """
    keys = list(requests)
    weights = [1] * len(keys) if tokens is None else list(tokens)
    if len(weights) != len(keys):
        raise InvalidValueError(f"tokens: expected {len(keys)} values, got {len(weights)}")
    cache = SlotCache(capacity, build_policy(policy, keys if policy == "belady" else None))
    return [cache.access(k, t).hit for k, t in zip(keys, weights, strict=True)]
