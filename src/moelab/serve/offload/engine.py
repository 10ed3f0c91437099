"""The offload engine: per-layer expert caches over a lossless store, fed by the scheduler.

For every MoE layer call the engine receives the experts the routing plan needs (with their
token counts), looks each up in the layer's cache, and returns the decompressed weights —
cache hits at once, misses as the scheduler finishes them (so the expert matmuls of ready
experts overlap the remaining loads).

Caching (one cache per layer, each with ``budget / L`` bytes, as ZipMoE's planner divides
memory per layer; a layer never gets more slots than it has experts, ``E_l`` of the store's
``experts_per_layer``, which differ between layers of a pruned model):
- policy ``zipmoe``: two tiers (:class:`TwoTierCache`) sized by the planner
  (:func:`plan_tiers`) from the store's routing profile, token-weighted LFU with admission;
  without a profile, or for top-1 models, one token-LFU tier (the planner's fallback);
- ``lru``/``lfu``/``fifo``/``belady``: one tier of ``⌊budget/L / expert bytes⌋`` slots
  (:class:`SlotCache`); ``belady`` needs the recorded request sequence of every layer;
- ``none``: no expert cache at all, every requested expert is loaded on demand and dropped
  after the layer (the Accelerate / DeepSpeed-style offloading of the paper's weakest
  baselines [I: how those tools offload]).

Loads: ``threads = 0`` loads serially on the calling thread (naive offloading); otherwise the
:class:`Scheduler`'s pools load misses in parallel. ``threads = None`` takes the cores that
torch's intra-op threads leave free (at least 1), so decode threads do not oversubscribe the
machine (:func:`free_cores`). ``prefetch = n`` guesses ``n`` experts of
the next layer (``predictor``: its router on the current hidden state, or routing history) and,
once this layer's loads are queued, queues theirs at prefetch priority: promoted when the next
layer asks for them, cancelled when it does not. The staging buffer for them is paid from the
cache budget, from the bytes the per-layer split leaves unused first, then from as few layers
as possible (:meth:`OffloadEngine._single_tier_slots`, :meth:`OffloadEngine._zipmoe_plans`).
Budgets are in MiB (2^20 bytes).

Statistics (:class:`OffloadStats`): requests, hits per tier, misses, prefetch hits, bytes read,
read/decode/merge seconds, seconds the forward pass waited for loads.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from moelab.compress.lossless.model_store import OpenStore, trace_problem
from moelab.compress.lossless.tensor_codec import decode_tensor
from moelab.errors import InvalidValueError
from moelab.serve.offload.planner import PLANNERS, DelayModel, TierPlan, plan_tiers
from moelab.serve.offload.policies import POLICIES, SlotCache, build_policy
from moelab.serve.offload.pool import PREFETCH
from moelab.serve.offload.prefetch import ExpertPredictor
from moelab.serve.offload.scheduler import Scheduler, TensorTask
from moelab.serve.offload.tiers import ADMISSIONS, TwoTierCache

MIB = 1 << 20
VERIFY = ("first", "always", "off")
PREDICTORS = ("gate", "history")
ENGINE_POLICIES = (*POLICIES, "none")


def free_cores() -> int:
    """Cores this process may use less torch's intra-op threads, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - torch.get_num_threads())


@dataclass
class OffloadConfig:
    """Settings of the offloaded experts.

    Attributes:
        cache_mb: cache budget in MiB for all layers (>= top_k experts' bytes).
        policy: ``zipmoe``, ``lru``, ``lfu``, ``fifo``, ``belady`` or ``none`` (no cache).
        threads: decode threads (0 = load serially on the forward thread; None = the cores
            torch leaves free, :func:`free_cores`).
        prefetch: experts of the next layer to prefetch (0 = off).
        predictor: how they are guessed: ``gate`` (the next layer's router on the current
            hidden state, :mod:`moelab.serve.offload.lookahead`; set up by
            :func:`moelab.serve.offload.load_offloaded`) or ``history`` (the ZipMoE authors'
            frequency predictor, :mod:`moelab.serve.offload.prefetch`).
        storage_mbps: emulated storage bandwidth in MB/s (10^6 B/s); None = real reads only.
        verify: sha256-check decoded tensors ``first`` time each is loaded, ``always``, or
            ``off`` (segment CRC-32s are always checked).
        planner: ``zipmoe``'s tier split rule: ``authors`` (``CachePoolPlanningSimu``) or
            ``argmin`` (the earlier rule, an ablation; :mod:`moelab.serve.offload.planner`).
        admission: ``zipmoe``'s admission rule: ``authors`` (``ProactiveDecision``) or
            ``hysteresis`` (the earlier reading; :mod:`moelab.serve.offload.tiers`).
        future: for ``belady``: per layer, the experts it will request, in request order.
    """

    cache_mb: float
    policy: str = "zipmoe"
    threads: int | None = None
    prefetch: int = 0
    predictor: str = "gate"
    storage_mbps: float | None = None
    verify: str = "first"
    future: list[list[int]] | None = None
    planner: str = "authors"
    admission: str = "authors"

    def check(self) -> None:
        if not (isinstance(self.cache_mb, int | float) and 0 < self.cache_mb < math.inf):
            raise InvalidValueError(f"cache_mb: must be a finite number > 0, got {self.cache_mb}")
        if self.policy not in ENGINE_POLICIES:
            raise InvalidValueError(
                f"policy: must be one of {', '.join(ENGINE_POLICIES)}; got {self.policy!r}"
            )
        if self.threads is not None and self.threads < 0:
            raise InvalidValueError(f"threads: must be >= 0, got {self.threads}")
        if self.prefetch < 0:
            raise InvalidValueError(f"prefetch: must be >= 0, got {self.prefetch}")
        if self.predictor not in PREDICTORS:
            raise InvalidValueError(
                f"predictor: must be one of {', '.join(PREDICTORS)}; got {self.predictor!r}"
            )
        if self.verify not in VERIFY:
            raise InvalidValueError(
                f"verify: must be one of {', '.join(VERIFY)}; got {self.verify!r}"
            )
        if self.planner not in PLANNERS:
            raise InvalidValueError(
                f"planner: must be one of {', '.join(PLANNERS)}; got {self.planner!r}"
            )
        if self.admission not in ADMISSIONS:
            raise InvalidValueError(
                f"admission: must be one of {', '.join(ADMISSIONS)}; got {self.admission!r}"
            )
        if self.storage_mbps is not None and not self.storage_mbps > 0:
            raise InvalidValueError(f"storage_mbps: must be > 0, got {self.storage_mbps}")


@dataclass
class OffloadStats:
    """Counters of one engine (reset with :meth:`OffloadEngine.reset_stats`)."""

    requests: int = 0
    hits_full: int = 0
    hits_sm: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    prefetch_issued: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    merge_s: float = 0.0
    wait_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return (self.hits_full + self.hits_sm) / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass
class _Loading:
    """An expert being loaded: one future per tensor, and where to cache it afterwards."""

    futures: dict[str, Future]
    after: str | None


@dataclass
class LayerState:
    """One layer's cache state and the data of its resident experts."""

    slots: SlotCache | None
    tiers: TwoTierCache | None
    full: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    sm: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


class OffloadEngine:
    """Expert caches and loaders over an open store.

    Attributes:
        plans: with ``zipmoe``, each layer's :class:`TierPlan` (``plan``: the common one).
        slots_per_layer: the single-tier policies' full-expert slots per layer.

    Raises:
        ValueError: bad settings; a budget below one layer's top-k experts; ``zipmoe`` on an
            uncompressed (raw) store; ``belady`` without a per-layer future; a ``trace`` that
            is not ``[P, L, max E_l]`` counts (zero past each layer's experts).
    """

    def __init__(
        self, store: OpenStore, config: OffloadConfig, trace: np.ndarray | None = None
    ) -> None:
        config.check()
        if config.threads is None:
            config = replace(config, threads=free_cores())
        self.store, self.config = store, config
        self.pack = store.pack
        idx = self.pack.index
        self.L, self.k = idx["num_layers"], idx["top_k"]
        self.experts_per_layer = store.experts_per_layer
        self.raw = idx["codec"] == "raw"
        self.full_bytes, self.sm_bytes = store.expert_bytes()
        budget = config.cache_mb * MIB
        need = self.k * self.full_bytes
        if budget < need:
            raise InvalidValueError(
                f"cache_mb: {config.cache_mb} MiB is smaller than one layer's top-{self.k} "
                f"experts ({need / MIB:.4g} MiB); accepted: >= {_ceil2(need / MIB):.2f}"
            )
        self.slots_per_layer = self._single_tier_slots(budget)
        self.layer_bytes = budget / self.L
        if config.policy == "zipmoe" and self.raw:
            raise InvalidValueError(
                "policy zipmoe: needs a compressed store (this one is codec raw)"
            )
        if config.policy == "belady" and (config.future is None or len(config.future) != self.L):
            raise InvalidValueError(
                f"policy belady: needs the recorded requests of all {self.L} layers"
            )
        self.delay_model = self._measure_delays()
        if trace is not None:
            trace = np.asarray(trace)
            problem = trace_problem(trace, self.experts_per_layer)
            if problem:
                raise InvalidValueError(f"trace: {problem}")
        self.trace = trace if trace is not None else store.trace
        self.plans = self._zipmoe_plans() if config.policy == "zipmoe" else None
        self.layers = [self._new_layer(li) for li in range(self.L)]
        self.scheduler = Scheduler(
            self.pack, config.threads, self.delay_model.d_dec, self.delay_model.d_sm
        )
        self.predictor = ExpertPredictor(self.experts_per_layer)
        self.prefetching: dict[tuple[int, int], _Loading] = {}
        self._hints: dict[int, list[int]] = {}
        self._verified: set[tuple[int, int, str]] = set()
        self.stats = OffloadStats()
        self._base = (self.pack.bytes_read, self.pack.read_s)

    # ------------------------------------------------------------------------ setup
    def _measure_delays(self) -> DelayModel:
        """Delay constants from the store: ``d_dec`` = (chunk decodes, segment CRC-32s and
        recombination, as a decode thread does them) of expert (0, 0)'s tensors per chunk, the best of 3 timings here [I: the authors'
        constant is a profiled decompression time per tensor; our CPU recombination is not
        free, so it is included]; ``d_sm`` = one tensor's SM bytes at the capped or a measured read
        bandwidth; ``CR`` = coded / raw exponent bytes."""
        specs = list(self.pack.tensors(0, 0).values())
        T = len(specs)
        if self.raw:
            return DelayModel(T, max(1, self.config.threads), 1, 0.0, 1e-3, 1.0)
        chunks = max(1, len(specs[0]["chunks"]))
        refs = [r for s in specs for r in (*s["chunks"], s["sm"])]
        held = {(r["offset"], r["size"]): self.pack.read(r["offset"], r["size"]) for r in refs}
        n = sum(len(s["chunks"]) for s in specs)
        sms = [held[(s["sm"]["offset"], s["sm"]["size"])] for s in specs]
        times = []
        for _ in range(3):  # the best of 3: the first pays for cold caches, and a noisy
            t0 = time.perf_counter()  # constant would flip the plan from run to run
            for spec in specs:  # from memory: the chunk decodes, CRCs and recombination
                decode_tensor(spec, lambda offset, size: held[(offset, size)], verify=False)
            times.append(time.perf_counter() - t0)
        d_dec = min(times) / max(n, 1)
        sm_bytes = float(np.mean([len(b) for b in sms]))
        if self.config.storage_mbps is not None:
            bw = self.config.storage_mbps * 1e6
        else:
            t0 = time.perf_counter()
            nbytes = sum(len(self.pack.read(s["sm"]["offset"], s["sm"]["size"])) for s in specs)
            bw = nbytes / max(time.perf_counter() - t0, 1e-9)
        raw_exp = sum(s["numel"] for s in specs)
        coded = sum(r["size"] for s in specs for r in s["chunks"])
        return DelayModel(
            T, max(1, self.config.threads), chunks, d_dec, sm_bytes / bw, coded / max(raw_exp, 1)
        )

    def _staging_cuts(self, spare: float, capacity: list[int]) -> list[int]:
        """Full experts each layer gives up for the prefetch staging buffer (``prefetch``
        experts): the bytes the per-layer split leaves unused (``spare``, over all layers) pay
        first, the rest one expert at a time round-robin from layer 0 (never a prefetch
        target), at most ``capacity[l]`` from layer l, so the buffer costs at most its own
        size."""
        need = self.config.prefetch * self.full_bytes - spare
        n = max(0, math.ceil(need / self.full_bytes))
        return [min(capacity[i], n // self.L + (i < n % self.L)) for i in range(self.L)]

    def _single_tier_slots(self, budget: float) -> list[int]:
        """Full-expert slots per layer for the single-tier policies: ``⌊budget/L / expert⌋``
        each (at most the layer's experts), less the staging buffer's cuts
        (:meth:`_staging_cuts`)."""
        each = int(budget / self.L // self.full_bytes)
        slots = [min(E, each) for E in self.experts_per_layer]
        cuts = self._staging_cuts(budget - sum(slots) * self.full_bytes, slots)
        return [s - c for s, c in zip(slots, cuts, strict=True)]

    def _plan(self, layer_bytes: float, num_experts: int) -> TierPlan:
        """The planner's split of ``layer_bytes`` for a layer of ``num_experts`` experts, from
        the trace of the layers with that many experts; one LFU tier without a trace."""
        if self.trace is None:
            n = min(num_experts, int(layer_bytes // self.full_bytes))
            return TierPlan("lfu", n, 0, 1.0, math.nan)
        same = [li for li, E in enumerate(self.experts_per_layer) if num_experts == E]
        return plan_tiers(
            self.trace[:, same, :num_experts], self.k, num_experts, layer_bytes,
            self.full_bytes, self.sm_bytes, self.delay_model,
            num_layers=self.L, rule=self.config.planner,
        )  # fmt: skip

    def _zipmoe_plans(self) -> list[TierPlan]:
        """Per-layer plans. Every layer gets ``budget / L`` (layers with equal expert counts
        share one plan); the layers that pay for the prefetch staging buffer
        (:meth:`_staging_cuts`) are re-planned with the bytes left [our choice: a cut spread
        over all layers would cost every layer a slot whenever the budget is an exact multiple
        of the slot sizes]."""
        shares = {E: self._plan(self.layer_bytes, E) for E in set(self.experts_per_layer)}
        share = [shares[E] for E in self.experts_per_layer]
        used = [p.n_full * self.full_bytes + p.n_sm * self.sm_bytes for p in share]
        cuts = self._staging_cuts(
            sum(self.layer_bytes - u for u in used), [int(u // self.full_bytes) for u in used]
        )
        reduced: dict[tuple[int, int], TierPlan] = {}
        plans = []
        for li, c in enumerate(cuts):
            E = self.experts_per_layer[li]
            if c and (E, c) not in reduced:
                reduced[(E, c)] = self._plan(used[li] - c * self.full_bytes, E)
            plans.append(reduced[(E, c)] if c else share[li])
        return plans

    def _new_layer(self, li: int) -> LayerState:
        c = self.config
        if c.policy == "none":
            return LayerState(SlotCache(0, build_policy("lru")), None)
        if c.policy == "zipmoe":
            plan = self.plans[li]
            if plan.kind == "two_tier":
                E = self.experts_per_layer[li]
                tiers = TwoTierCache(plan.n_full, plan.n_sm, E, admission=c.admission)
                return LayerState(None, tiers)
            return LayerState(SlotCache(plan.n_full, build_policy("zipmoe")), None)
        cap = self.slots_per_layer[li]
        future = c.future[li] if c.policy == "belady" else None
        return LayerState(SlotCache(cap, build_policy(c.policy, future)), None)

    @property
    def plan(self) -> TierPlan | None:
        """The last layer's plan: the split every layer gets unless it pays for the staging
        buffer (None for the single-tier policies)."""
        return self.plans[-1] if self.plans else None

    def close(self) -> None:
        self.scheduler.close()

    def reset_stats(self) -> None:
        self.stats = OffloadStats()
        self._base = (self.pack.bytes_read, self.pack.read_s)

    def snapshot(self) -> OffloadStats:
        """A copy of the counters so far, with bytes read and read seconds from the pack (a
        copy, so that two snapshots can be subtracted)."""
        s = self.stats
        s.bytes_read = self.pack.bytes_read - self._base[0]
        s.read_s = self.pack.read_s - self._base[1]
        s.decode_s = self.scheduler.stats.decode_s
        s.merge_s = self.scheduler.stats.merge_s
        return replace(s)

    # ------------------------------------------------------------------------ loading
    def _verify(self, key: tuple[int, int, str]) -> bool:
        v = self.config.verify
        if v == "always":
            return True
        if v == "off" or key in self._verified:
            return False
        self._verified.add(key)
        return True

    def _tasks(self, li: int, e: int, sm: dict[str, np.ndarray] | None) -> list[TensorTask]:
        return [
            TensorTask(
                li, e, name, spec, None if sm is None else sm[name], self._verify((li, e, name))
            )
            for name, spec in self.pack.tensors(li, e).items()
        ]

    def _start(self, tasks: list[TensorTask]) -> dict[tuple[int, str], Future]:
        if self.config.threads == 0:
            return {(t.expert, t.name): self.scheduler.load_serial(t) for t in tasks}
        return {(t.expert, t.name): f for t, f in self.scheduler.submit(tasks)}

    def _install(
        self, st: LayerState, e: int, loading: _Loading, weights: dict[str, Tensor]
    ) -> None:
        if loading.after == "full":
            st.full[e] = weights
            st.sm.pop(e, None)
        elif loading.after == "sm":
            sm = {}
            for name, f in loading.futures.items():
                sm[name] = f.job.sm  # type: ignore[attr-defined]
            if all(v is not None for v in sm.values()):
                st.sm[e] = sm

    def fetch(self, li: int, counts: list[int]) -> Iterator[tuple[int, dict[str, Tensor]]]:
        """Yield ``(expert, {tensor name: weight})`` for every expert with ``counts[e] > 0`` at
        layer ``li``: hits first, then loads in completion order.

        Raises:
            StoreError: a segment or tensor fails its checksum (names the expert and file).
        """
        st = self.layers[li]
        ready: list[tuple[int, dict[str, Tensor]]] = []
        loads: dict[int, _Loading] = {}
        tasks: list[TensorTask] = []
        for e, c in enumerate(counts):
            if not c:
                continue
            self.stats.requests += 1
            if st.tiers is not None:
                acc = st.tiers.access(e, c)
                before, after, evicted = acc.before, acc.after, acc.evicted
            else:
                a = st.slots.access(e, c)
                before = "full" if a.hit else "miss"
                after = "full" if a.cached else None
                evicted = [(a.evicted, "full")] if a.evicted is not None else []
            held_full = st.full.get(e)
            held_sm = st.sm.get(e)
            for v, tier in evicted:
                (st.full if tier == "full" else st.sm).pop(v, None)
            if before == "full" and held_full is not None:
                self.stats.hits_full += 1
                ready.append((e, held_full))
                continue
            pre = self.prefetching.pop((li, e), None)
            if pre is not None:
                self.stats.prefetch_hits += 1
                self.stats.misses += 1
                pre.after = after
                self.scheduler.promote(list(pre.futures.values()))
                loads[e] = pre
                continue
            if before == "sm" and held_sm is not None:
                self.stats.hits_sm += 1
            else:
                self.stats.misses += 1
                held_sm = None
            new = self._tasks(li, e, held_sm)
            tasks.extend(new)
            loads[e] = _Loading({}, after)
        started = self._start(tasks)
        for (e, name), f in started.items():
            loads[e].futures[name] = f
        self._discard_prefetches(li)
        if self.config.prefetch and li + 1 < self.L:
            self._prefetch(li + 1)  # queued behind this layer's loads
        self.predictor.update(li, counts)
        yield from ready
        pending = dict(loads)
        while pending:
            t0 = time.perf_counter()
            done_e = [e for e, ld in pending.items() if all(f.done() for f in ld.futures.values())]
            if not done_e:  # wait on the unfinished ones: a finished one would return at once
                wait(
                    [f for ld in pending.values() for f in ld.futures.values() if not f.done()],
                    return_when=FIRST_COMPLETED,
                )
                self.stats.wait_s += time.perf_counter() - t0
                continue
            for e in done_e:
                ld = pending.pop(e)
                weights = {n: f.result() for n, f in ld.futures.items()}
                self._install(st, e, ld, weights)
                yield e, weights

    def hint(self, li: int, experts: list[int]) -> None:
        """The ``gate`` predictor's guess of layer ``li``'s experts (from
        :mod:`moelab.serve.offload.lookahead`), used when layer ``li - 1`` is fetched."""
        self._hints[li] = experts

    def _discard_prefetches(self, li: int) -> None:
        for key in [k for k in self.prefetching if k[0] == li]:
            self.scheduler.cancel(list(self.prefetching.pop(key).futures.values()))

    def _prefetch(self, li: int) -> None:
        if self.config.threads == 0:
            return  # serial loading cannot overlap; prefetch needs threads
        st = self.layers[li]
        if self.config.predictor == "gate":
            guess = self._hints.pop(li, [])[: self.config.prefetch]
        else:
            guess = self.predictor.predict(li, self.config.prefetch)
        for e in guess:
            if e in st.full or (li, e) in self.prefetching:
                continue
            tasks = self._tasks(li, e, st.sm.get(e))
            started = self.scheduler.submit(tasks, PREFETCH)
            self.prefetching[(li, e)] = _Loading({t.name: f for t, f in started}, None)
            self.stats.prefetch_issued += 1


def _ceil2(x: float) -> float:
    """``x`` rounded up to 2 decimals: a minimum shown rounded down would be refused too."""
    return math.ceil(x * 100) / 100
