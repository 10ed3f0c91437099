"""Loading expert tensors from the store with thread pools that overlap reads with
decompression (ZipMoE's scheduler, the authors' ``ZipMoESchedulerFunc`` as the research notes,
section (c), describe it).

Each tensor to load is a task of one of two types:

- **Type-I**: its sign-mantissa (SM) bytes are not cached: the read and decode of its exponent
  chunks plus one SM read;
- **Type-II**: its SM bytes are cached: only the exponent chunks.

:func:`dispatch_order` interleaves them: dispatch one Type-I task, then Type-II tasks until the
accumulated compute bottleneck ``#chunk ops / P · d_dec`` exceeds the I/O bottleneck
``#Type-I · d_sm``; repeat. The Type-II tasks keep the ``P`` decode threads busy while the
Type-I SM reads are in flight. The last finished part of a tensor recombines it (numpy bit
ops, on a decode thread) and checks its sha256. ``zstandard``, ``os.pread``, ``hashlib``, numpy
and ``zlib.crc32`` release the GIL on large buffers; ``constriction``'s ANS decoder may not, so
ANS-coded stores parallelise less.

Priorities (:mod:`moelab.serve.offload.pool`): loads the forward pass waits for go before
prefetches in both pools; a prefetch that becomes a demand is promoted, and the queued parts of
one whose layer has passed are cancelled (the authors pre-empt mispredicted prefetch tasks).

Our choices [I]: every read (exponent chunks, then the SM bytes, of each task in dispatch
order) goes to the one I/O thread, so the storage device, which serves one request at a time,
serves them in priority order; the authors read exponent chunks on the compute threads, where
they mostly come from the page cache. A tensor's exponent chunks are one request. The I/O
thread only reads: CRC-32 checks, chunk decodes and the recombination (one piece per chunk)
run on the ``P`` compute threads in priority order, so that the next read is issued at once
and the forward pass, after a tensor's last read, waits for part of one recombination.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from moelab.compress.lossless.store import ExpertPack, StoreError
from moelab.compress.lossless.tensor_codec import (
    TensorDecodeError,
    assemble,
    check_length,
    check_segment,
    check_streams,
    decode_exponent_chunk,
    decode_raw,
    empty_bits,
    finish_tensor,
    merge_range,
)
from moelab.errors import InvalidValueError
from moelab.serve.offload.pool import DEMAND, Entry, PriorityPool


@dataclass
class TensorTask:
    """One tensor to load: ``(layer, expert, name)``, its placed spec, cached SM bytes (Type-II)
    or None (Type-I), and whether to check its sha256."""

    layer: int
    expert: int
    name: str
    spec: dict[str, Any]
    sm: np.ndarray | None
    verify: bool

    @property
    def type_one(self) -> bool:
        return self.sm is None

    @property
    def n_chunks(self) -> int:
        return len(self.spec.get("chunks", ()))


def dispatch_order(
    tasks: list[TensorTask], threads: int, d_dec: float, d_sm: float
) -> list[TensorTask]:
    """ZipMoE's interleaving of Type-I and Type-II tasks (see the module docstring); within a
    type the input order is kept."""
    one = [t for t in tasks if t.type_one]
    two = [t for t in tasks if not t.type_one]
    order: list[TensorTask] = []
    ops = n_io = 0
    i = j = 0
    while i < len(one) or j < len(two):
        if i < len(one):
            order.append(one[i])
            ops += one[i].n_chunks
            n_io += 1
            i += 1
            while j < len(two) and ops / threads * d_dec <= n_io * d_sm:
                order.append(two[j])
                ops += two[j].n_chunks
                j += 1
        else:
            order.extend(two[j:])
            j = len(two)
    return order


@dataclass
class LoadStats:
    """Seconds spent (summed over threads) decoding chunks and recombining tensors."""

    decode_s: float = 0.0
    merge_s: float = 0.0
    tensors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, decode: float = 0.0, merge: float = 0.0, tensors: int = 0) -> None:
        with self._lock:
            self.decode_s += decode
            self.merge_s += merge
            self.tensors += tensors


def _edges(spec: dict[str, Any]) -> list[int]:
    """Element offsets where a ``split`` tensor's exponent chunks start, and its end."""
    return [0, *itertools.accumulate(spec["chunk_symbols"])]


class _Job:
    """A tensor being assembled from ``parts`` pieces that finish on different threads, with
    its priority and its queued pool entries (to promote or cancel them)."""

    def __init__(self, task: TensorTask, parts: int, priority: int) -> None:
        self.task = task
        self.exp = np.empty(task.spec["numel"], dtype=np.uint8)
        self.sm = task.sm
        self.future: Future = Future()
        self.future.job = self  # type: ignore[attr-defined]
        self.priority = priority
        self.entries: list[tuple[PriorityPool, Entry]] = []
        self.sm_blob: bytes | None = None  # SM bytes read for this load, CRC not yet checked
        self.bits: np.ndarray | None = None
        self._left = parts
        self.lock = threading.Lock()

    def arm(self, parts: int) -> None:
        """Start counting the next phase's ``parts``."""
        with self.lock:
            self._left = parts

    def part_done(self) -> bool:
        """Count one finished part; True for the last."""
        with self.lock:
            self._left -= 1
            return self._left == 0

    def settle(self, result: Tensor | None = None, error: BaseException | None = None) -> None:
        with self.lock:
            if self.future.done():  # failed or cancelled already
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)


class Scheduler:
    """Priority thread pools that load tensors from ``pack``.

    Args:
        pack: the store's pack reader.
        threads: P decode threads (>= 1; 0 = no pools, only :meth:`load_serial`); one extra
            thread does every read.
        d_dec, d_sm: delay constants for :func:`dispatch_order` (seconds).
    """

    def __init__(self, pack: ExpertPack, threads: int, d_dec: float, d_sm: float) -> None:
        if threads < 0:
            raise InvalidValueError(f"threads: must be >= 0, got {threads}")
        self.pack = pack
        self.threads = threads
        self.d_dec, self.d_sm = d_dec, d_sm
        self.pools = (
            (PriorityPool(threads, "moelab-decode"), PriorityPool(1, "moelab-read"))
            if threads
            else None
        )
        self.stats = LoadStats()

    @property
    def compute(self) -> PriorityPool:
        return self._pools()[0]

    @property
    def io(self) -> PriorityPool:
        return self._pools()[1]

    def _pools(self) -> tuple[PriorityPool, PriorityPool]:
        if self.pools is None:
            raise RuntimeError("Scheduler: built with threads=0 (serial loads only)")
        return self.pools

    def close(self) -> None:
        for pool in self.pools or ():
            pool.shutdown()

    # -------------------------------------------------------------- the pieces
    def _fail(self, task: TensorTask, e: BaseException) -> BaseException:
        if isinstance(e, StoreError) or not isinstance(e, TensorDecodeError | OSError):
            return e  # a StoreError names the expert already; anything else is a bug
        return StoreError(f"{self.pack.where(task.layer, task.expert, task.name)}: {e}")

    def _decode_into(self, job: _Job, i: int, start: int, blob: bytes) -> None:
        t0 = time.perf_counter()
        try:
            part = decode_exponent_chunk(job.task.spec, i, blob)
        except TensorDecodeError as e:
            raise self._fail(job.task, e) from None
        job.exp[start : start + part.shape[0]] = part
        self.stats.add(decode=time.perf_counter() - t0)

    def _assembled(self, job: _Job) -> Tensor:
        t0 = time.perf_counter()
        try:
            out = assemble(job.task.spec, job.exp, job.sm, job.task.verify)
        except TensorDecodeError as e:
            raise self._fail(job.task, e) from None
        self.stats.add(merge=time.perf_counter() - t0, tensors=1)
        return out

    def _raw_tensor(self, task: TensorTask, blob: bytes) -> Tensor:
        """A ``raw``-layout tensor from its unchecked bytes."""
        try:
            check_segment(blob, task.spec["raw"], "raw bytes")
            out = decode_raw(task.spec, blob, task.verify)
        except TensorDecodeError as e:
            raise self._fail(task, e) from None
        self.stats.add(tensors=1)
        return out

    # -------------------------------------------------------------- pool entries
    def _queue(self, pool: PriorityPool, job: _Job, fn: Callable[..., None], *args: Any) -> None:
        with job.lock:  # so that a promotion cannot miss an entry queued concurrently
            job.entries.append(
                (pool, pool.submit(job.priority, Entry(self._guarded, job, fn, args)))
            )

    def _guarded(self, job: _Job, fn: Callable[..., None], args: tuple) -> None:
        if job.future.done():
            return
        try:
            fn(job, *args)
        except BaseException as e:  # delivered to the waiting forward pass
            job.settle(error=self._fail(job.task, e))

    def _chunk_blobs(self, task: TensorTask, check: bool = True) -> list[bytes]:
        refs = task.spec["chunks"]
        what = [f"exponent chunk {i}" for i in range(len(refs))]
        return self.pack.read_segments(task.layer, task.expert, task.name, refs, what, check)

    def _read(self, ref: dict[str, Any]) -> bytes:
        """A segment's bytes, unchecked: its CRC-32 is checked on a decode thread, so that
        the I/O thread can issue the next read at once."""
        return self.pack.read(ref["offset"], ref["size"])

    def _read_chunks(self, job: _Job) -> None:
        edges = _edges(job.task.spec)
        for i, blob in enumerate(self._chunk_blobs(job.task, check=False)):
            self._queue(self.compute, job, self._decode_chunk, i, edges[i], blob)

    def _decode_chunk(self, job: _Job, i: int, start: int, blob: bytes) -> None:
        blob = check_segment(blob, job.task.spec["chunks"][i], f"exponent chunk {i}")
        self._decode_into(job, i, start, blob)
        if job.part_done():
            self._merge_pieces(job)

    def _read_sm(self, job: _Job) -> None:
        job.sm_blob = self._read(job.task.spec["sm"])
        check_length(job.sm_blob, job.task.spec["sm"], "sign-mantissa bytes")
        job.sm = np.frombuffer(job.sm_blob, dtype=np.uint8)
        if job.part_done():
            self._merge_pieces(job)

    def _merge_pieces(self, job: _Job) -> None:
        """Queue the recombination as one piece per exponent chunk, plus the CRC-32 check of
        freshly read SM bytes, on the decode threads; the last of them finishes the tensor.
        (Pieces rather than one merge: both threads share the work, and the forward pass
        waits for only part of it after the tensor's last read.)"""
        spec = job.task.spec
        check_streams(spec, job.exp, job.sm)
        job.bits = empty_bits(spec)
        pieces = list(itertools.pairwise(_edges(spec)))
        job.arm(len(pieces) + (job.sm_blob is not None))
        if job.sm_blob is not None:
            self._queue(self.compute, job, self._check_sm)
        for a, b in pieces:
            self._queue(self.compute, job, self._merge_piece, a, b)
        if not pieces and job.sm_blob is None:
            self._finish(job)

    def _check_sm(self, job: _Job) -> None:
        check_segment(job.sm_blob, job.task.spec["sm"], "sign-mantissa bytes")
        if job.part_done():
            self._finish(job)

    def _merge_piece(self, job: _Job, a: int, b: int) -> None:
        t0 = time.perf_counter()
        merge_range(job.task.spec, job.bits, job.exp, job.sm, a, b)
        self.stats.add(merge=time.perf_counter() - t0)
        if job.part_done():
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        t0 = time.perf_counter()
        out = finish_tensor(job.task.spec, job.bits, job.task.verify)
        self.stats.add(merge=time.perf_counter() - t0, tensors=1)
        job.settle(out)

    def _read_raw(self, job: _Job) -> None:
        blob = self._read(job.task.spec["raw"])
        self._queue(self.compute, job, self._decode_raw, blob)

    def _decode_raw(self, job: _Job, blob: bytes) -> None:
        job.settle(self._raw_tensor(job.task, blob))

    # -------------------------------------------------------------- public
    def submit(
        self, tasks: list[TensorTask], priority: int = DEMAND
    ) -> list[tuple[TensorTask, Future]]:
        """Start loading ``tasks`` in ZipMoE dispatch order at ``priority`` (``DEMAND`` or
        ``PREFETCH``); returns a future per task (resolving to the decoded tensor; its
        ``job`` attribute keeps the SM bytes)."""
        out = []
        for task in dispatch_order(tasks, self.threads, self.d_dec, self.d_sm):
            if task.spec["layout"] == "raw":
                job = _Job(task, 1, priority)
                self._queue(self.io, job, self._read_raw)
                out.append((task, job.future))
                continue
            job = _Job(task, task.n_chunks + task.type_one, priority)
            if task.n_chunks:
                self._queue(self.io, job, self._read_chunks)
            if task.type_one:
                self._queue(self.io, job, self._read_sm)
            if task.n_chunks + task.type_one == 0:  # empty tensor
                job.settle(self._assembled(job))
            out.append((task, job.future))
        return out

    def promote(self, futures: list[Future]) -> None:
        """Raise the queued parts of these loads (prefetches now needed) to ``DEMAND``."""
        for f in futures:
            job = f.job  # type: ignore[attr-defined]
            with job.lock:
                if job.priority == DEMAND:
                    continue
                job.priority = DEMAND
                for pool, entry in job.entries:
                    pool.submit(DEMAND, entry)

    def cancel(self, futures: list[Future]) -> None:
        """Drop the queued parts of these loads (prefetches of a layer that has passed)."""
        for f in futures:
            job = f.job  # type: ignore[attr-defined]
            with job.lock:
                for _, entry in job.entries:
                    entry.claim()
                f.cancel()

    def load_serial(self, task: TensorTask) -> Future:
        """Load one tensor on the calling thread (naive offloading); returns a finished
        future like :meth:`submit`'s (its ``job.sm`` holds the SM bytes of a split tensor).

        Raises:
            StoreError: a segment or the tensor fails its checksum.
        """
        job = _Job(task, 0, DEMAND)
        if task.spec["layout"] == "raw":
            job.settle(self._raw_tensor(task, self._read(task.spec["raw"])))
            return job.future
        edges = _edges(task.spec)
        for i, blob in enumerate(self._chunk_blobs(task)):
            self._decode_into(job, i, edges[i], blob)
        if task.type_one:
            job.sm = np.frombuffer(
                self.pack.read_segment(
                    task.layer, task.expert, task.name, task.spec["sm"], "sign-mantissa bytes"
                ),
                np.uint8,
            )
        job.settle(self._assembled(job))
        return job.future
