"""Loading expert tensors from the store with a thread pool that overlaps reads with
decompression (ZipMoE's scheduler, the authors' ``ZipMoESchedulerFunc`` as the research notes,
section (c), describe it).

Each tensor to load is a task of one of two types:

- **Type-I**: its sign-mantissa (SM) bytes are not cached: one SM read (I/O) plus the read and
  decode of its exponent chunks (compute);
- **Type-II**: its SM bytes are cached: only the exponent chunks (compute).

:func:`dispatch_order` interleaves them: dispatch one Type-I task, then Type-II tasks until the
accumulated compute bottleneck ``#chunk ops / P · d_dec`` exceeds the I/O bottleneck
``#Type-I · d_sm``; repeat. The Type-II tasks keep the ``P`` decode threads busy while the
Type-I SM reads are in flight. SM reads go to one I/O thread (a storage device serves one
request at a time); exponent chunk reads+decodes go to the ``P`` compute threads in dispatch
order; the last finished part of a tensor recombines it (numpy bit ops) and checks its sha256.
``zstandard``, ``os.pread``, ``hashlib``, numpy and ``zlib.crc32`` release the GIL on large
buffers; ``constriction``'s ANS decoder may not, so ANS-coded stores parallelise less.

Our choices [I]: pre-emption of mispredicted prefetch tasks is not implemented (a prefetch
that is not used is simply discarded when its layer has passed); priorities are the dispatch
order (FIFO pools).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from moelab.compress.lossless.store import ExpertPack, StoreError
from moelab.compress.lossless.tensor_codec import (
    TensorDecodeError,
    assemble,
    decode_exponent_chunk,
    decode_raw,
)
from moelab.errors import InvalidValueError


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


class _Job:
    """A tensor being assembled from ``parts`` pieces that finish on different threads."""

    def __init__(self, task: TensorTask, parts: int, finish: Callable[[_Job], Tensor]) -> None:
        self.task = task
        self.exp = np.empty(task.spec["numel"], dtype=np.uint8)
        self.sm = task.sm
        self.future: Future = Future()
        self._left = parts
        self._lock = threading.Lock()
        self._finish = finish

    def part_done(self, error: BaseException | None = None) -> None:
        if error is not None:
            if not self.future.done():
                self.future.set_exception(error)
            return
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and not self.future.done():
            try:
                self.future.set_result(self._finish(self))
            except BaseException as e:  # delivered to the waiting forward pass
                self.future.set_exception(e)


class Scheduler:
    """Thread pools that load tensors from ``pack``.

    Args:
        pack: the store's pack reader.
        threads: P decode threads (>= 1); one extra thread does the SM / raw reads.
        d_dec, d_sm: delay constants for :func:`dispatch_order` (seconds).
    """

    def __init__(self, pack: ExpertPack, threads: int, d_dec: float, d_sm: float) -> None:
        if threads < 1:
            raise InvalidValueError(f"threads: must be >= 1, got {threads}")
        self.pack = pack
        self.threads = threads
        self.d_dec, self.d_sm = d_dec, d_sm
        self.compute = ThreadPoolExecutor(threads, thread_name_prefix="moelab-decode")
        self.io = ThreadPoolExecutor(1, thread_name_prefix="moelab-read")
        self.stats = LoadStats()

    def close(self) -> None:
        self.compute.shutdown(wait=True, cancel_futures=True)
        self.io.shutdown(wait=True, cancel_futures=True)

    # -------------------------------------------------------------- pieces run on threads
    def _fail(self, task: TensorTask, e: BaseException) -> BaseException:
        if isinstance(e, StoreError):
            return e
        return StoreError(f"{self.pack.where(task.layer, task.expert, task.name)}: {e}")

    def _read_sm(self, job: _Job) -> None:
        t = job.task
        try:
            blob = self.pack.read_segment(
                t.layer, t.expert, t.name, t.spec["sm"], "sign-mantissa bytes"
            )
            job.sm = np.frombuffer(blob, dtype=np.uint8)
        except BaseException as e:
            job.part_done(self._fail(t, e))
            return
        job.part_done()

    def _chunk(self, job: _Job, i: int, start: int) -> None:
        t = job.task
        try:
            blob = self.pack.read_segment(
                t.layer, t.expert, t.name, t.spec["chunks"][i], f"exponent chunk {i}"
            )
            t0 = time.perf_counter()
            part = decode_exponent_chunk(t.spec, i, blob)
            job.exp[start : start + part.shape[0]] = part
            self.stats.add(decode=time.perf_counter() - t0)
        except BaseException as e:
            job.part_done(self._fail(t, e))
            return
        job.part_done()

    def _assemble(self, job: _Job) -> Tensor:
        t0 = time.perf_counter()
        try:
            out = assemble(job.task.spec, job.exp, job.sm, job.task.verify)
        except TensorDecodeError as e:
            raise self._fail(job.task, e) from None
        self.stats.add(merge=time.perf_counter() - t0, tensors=1)
        return out

    def _raw(self, task: TensorTask) -> Tensor:
        blob = self.pack.read_segment(
            task.layer, task.expert, task.name, task.spec["raw"], "raw bytes"
        )
        try:
            out = decode_raw(task.spec, blob, task.verify)
        except TensorDecodeError as e:
            raise self._fail(task, e) from None
        self.stats.add(tensors=1)
        return out

    # -------------------------------------------------------------- public
    def submit(self, tasks: list[TensorTask]) -> list[tuple[TensorTask, Future]]:
        """Start loading ``tasks`` in ZipMoE dispatch order; returns a future per task
        (resolving to the decoded tensor, its SM bytes kept on ``job``)."""
        out = []
        for task in dispatch_order(tasks, self.threads, self.d_dec, self.d_sm):
            if task.spec["layout"] == "raw":
                out.append((task, self.io.submit(self._raw, task)))
                continue
            bounds = np.cumsum([0, *task.spec["chunk_symbols"]])
            job = _Job(task, task.n_chunks + task.type_one, self._assemble)
            if task.type_one:
                self.io.submit(self._read_sm, job)
            for i in range(task.n_chunks):
                self.compute.submit(self._chunk, job, i, int(bounds[i]))
            if task.n_chunks + task.type_one == 0:  # empty tensor
                job.future.set_result(self._assemble(job))
            job.future.job = job  # type: ignore[attr-defined]
            out.append((task, job.future))
        return out

    def load_serial(self, task: TensorTask) -> tuple[Tensor, np.ndarray | None]:
        """Load one tensor on the calling thread (naive offloading); returns it and, for the
        split layout, its SM bytes."""
        if task.spec["layout"] == "raw":
            return self._raw(task), None
        parts = task.n_chunks + task.type_one
        job = _Job(task, parts, self._assemble)
        if task.type_one:
            self._read_sm(job)
        bounds = np.cumsum([0, *task.spec["chunk_symbols"]])
        for i in range(task.n_chunks):
            if job.future.done():
                break
            self._chunk(job, i, int(bounds[i]))
        if parts == 0:
            job.future.set_result(self._assemble(job))
        return job.future.result(), job.sm
