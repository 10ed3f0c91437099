"""The expert store: one pack file of encoded expert tensors plus a JSON index.

Files (``FORMAT_VERSION = 4``)::

    experts.pack   segments of every expert tensor, back to back (exponent chunks, then
                   sign-mantissa bytes; or raw bit patterns)
    store.json     {"format_version": 4, "pack": "experts.pack", "pack_bytes": N,
                    "model_fingerprint": ..., "num_layers": L,
                    "experts_per_layer": [E_0, …, E_{L-1}], "num_experts": max E_l,
                    "dtype": ..., "codec": ...,
                    "experts": [{"layer": l, "expert": e,
                                 "tensors": {"w_gate_up": spec, "w_down": spec}}],
                    "files": {"tokenizer.json": sha256, ...},
                    "index_sha256": ...}

``files`` (version 4) records the SHA-256 of the files stored beside the experts that change
what the model computes or how its text is read (the tokenizer files, ``run.json``): a
swapped tokenizer would otherwise change every score silently.

``experts_per_layer`` (version 3) gives each MoE layer its own expert count (a pruned model
keeps different numbers per layer); earlier stores have one count, ``num_experts``, for every
layer. Opening a store checks that the index lists every expert of every layer.

``index_sha256`` (version 2) is the SHA-256 of the rest of the index as canonical JSON, so an
edited or damaged index fails when the store is opened, not halfway through a generation.
The pack itself is covered by its segments' CRC-32s (:meth:`ExpertPack.verify`; version-1
stores also recorded an unused ``pack_sha256``).

``spec`` is :meth:`EncodedTensor.place`'s output: offsets, sizes and CRC-32 of every segment and
the SHA-256 of the tensor. Reads are positioned (``os.pread``) and touch only the segments
asked for; the whole pack is never loaded. A pack whose size differs from the index, a segment
whose CRC-32 fails, or a tensor whose SHA-256 fails raises :class:`StoreError` naming the
file, the layer, the expert and the tensor. The store is written inside a temporary folder that
is renamed into place (:func:`moelab.utils.atomic.write_folder_atomically`), so a failed write
leaves nothing behind.

Two storage regimes (this project's, not the paper's):

- *Uncached reads* (``uncached=True``): real reads from the device, the page cache dropped.
  Readahead is disabled on the pack (``POSIX_FADV_RANDOM``) and after every read the pack's
  cached pages are dropped (``POSIX_FADV_DONTNEED``, no root needed), so each read goes to the
  disk — on an NVMe-class disk, the regime of the ZipMoE paper (its Jetson reads from NVMe
  SSDs and drops the page cache before each run).
- *Emulated cap* (``storage_mbps``, optional ``latency_ms``): reads are timed as if the pack
  sat on a single-queue device of that bandwidth (MB = 10^6 bytes) and per-request latency:
  a read of ``n`` bytes issued at ``t`` completes at ``max(t, busy_until) + latency + n / bw``
  and the reader sleeps until then. Reads are still real file reads, normally served from the
  page cache underneath, so the cap models a CPU-to-I/O ratio (how much decode work a read's
  time pays for), not a particular device.

What the checksums cover: ``index_sha256`` (over the rest of ``store.json``) and the
recorded SHA-256s of ``dense.safetensors``, the profile and the ``files`` catch corruption and
files swapped in from elsewhere, not deliberate edits: whoever edits the index can recompute
every checksum, so none of them binds an entry to its expert (two experts' entries swapped,
with the checksums recomputed, read as each other). A store is as trustworthy as the place it
came from, like any checkpoint. The pack's name is confined to the store folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from moelab.compress.lossless.tensor_codec import (
    EncodedTensor,
    TensorDecodeError,
    decode_tensor,
    read_segment,
)
from moelab.errors import InvalidValueError
from moelab.models.io import CheckpointError
from moelab.utils.atomic import atomic_write_json
from moelab.utils.jsonfile import read_json
from moelab.utils.paths import UnsafePathError, confined

FORMAT_VERSION = 4
PACK_FILE = "experts.pack"
INDEX_FILE = "store.json"


class StoreError(CheckpointError):
    """The expert store is missing, truncated, corrupt, or from another model; the message
    names the file (and the expert/tensor where one is at fault)."""


class BandwidthLimiter:
    """Emulates a storage device of ``mbps`` megabytes (10^6 B) per second and ``latency_ms``
    per request, one request at a time, shared by all threads that read through it.

    Raises:
        ValueError: ``mbps`` is not > 0 or ``latency_ms`` < 0.
    """

    def __init__(self, mbps: float, latency_ms: float = 0.0) -> None:
        if not mbps > 0:
            raise InvalidValueError(f"storage_mbps: must be > 0, got {mbps}")
        if not latency_ms >= 0:
            raise InvalidValueError(f"latency_ms: must be >= 0, got {latency_ms}")
        self.bytes_per_s = mbps * 1e6
        self.latency_s = latency_ms / 1e3
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def wait(self, nbytes: int, issued: float) -> None:
        """Block until a read of ``nbytes`` issued at ``issued`` (``time.perf_counter``) would
        complete on the emulated device."""
        with self._lock:
            start = max(issued, self._busy_until)
            done = start + self.latency_s + nbytes / self.bytes_per_s
            self._busy_until = done
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class PackWriter:
    """Appends encoded tensors to an open pack file and builds the index entries."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.offset = 0

    def add(self, enc: EncodedTensor) -> dict[str, Any]:
        """Write ``enc``'s segments; return its placed spec."""
        spec = enc.place(self.offset)
        for seg in enc.segments:
            self._f.write(seg)
            self.offset += len(seg)
        return spec


def is_store(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a store index (``store.json``)."""
    return (Path(folder) / INDEX_FILE).is_file()


def write_index(folder: Path, index: dict[str, Any]) -> None:
    """Write ``store.json`` (adds the format version and the index's own checksum)."""
    body = {"format_version": FORMAT_VERSION, **index}
    atomic_write_json(folder / INDEX_FILE, {**body, "index_sha256": _index_digest(body)})


def _index_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _experts_per_layer(index: dict[str, Any], ipath: Path) -> list[int]:
    """Each layer's expert count: ``experts_per_layer`` (format 3), else ``num_experts`` for
    every layer (formats 1 and 2). Raises StoreError when they disagree or are malformed."""
    L, E = index["num_layers"], index["num_experts"]
    counts = index.get("experts_per_layer", [E] * L if isinstance(L, int) else None)
    ok = (
        isinstance(counts, list)
        and len(counts) == L
        and all(isinstance(c, int) and c >= 1 for c in counts)
        and max(counts, default=0) == E
    )
    if not ok:
        raise StoreError(
            f"{ipath}: experts_per_layer {counts!r} does not fit num_layers {L!r} and "
            f"num_experts {E!r}"
        )
    return counts


class ExpertPack:
    """Read access to a store's pack: index lookups and positioned reads.

    Args:
        folder: the store folder.
        storage_mbps: optional bandwidth cap (see the module docstring).
        latency_ms: per-request latency of the cap.
        uncached: drop the pack's page cache around every read (see the module docstring).
    Raises:
        StoreError: missing/unreadable index, newer format version, missing pack, or a pack
            whose size differs from the index (truncated or appended to).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        storage_mbps: float | None = None,
        *,
        latency_ms: float = 0.0,
        uncached: bool = False,
    ) -> None:
        self.folder = Path(folder)
        ipath = self.folder / INDEX_FILE
        index = read_json(ipath, StoreError)
        v = index.get("format_version") if isinstance(index, dict) else None
        if not isinstance(v, int) or not 1 <= v <= FORMAT_VERSION:
            raise StoreError(f"{ipath}: unsupported or missing format_version {v!r}")
        if v >= 2 and index.pop("index_sha256", None) != _index_digest(index):
            raise StoreError(
                f"{ipath}: checksum mismatch (edited or corrupt; write the store again)"
            )
        self.index = index
        try:  # a name read from a file stays inside its folder (the rule run folders follow)
            self.path = confined(self.folder, index.get("pack", PACK_FILE), what="pack")
        except UnsafePathError as e:
            raise StoreError(f"{ipath}: {e}") from None
        if not self.path.is_file():
            raise StoreError(f"{self.path}: missing (listed in {INDEX_FILE})")
        for key in ("pack_bytes", "experts", "num_layers", "num_experts", "top_k", "codec"):
            if key not in index:
                raise StoreError(
                    f"{ipath}: no {key!r} entry (not a moelab store index, or damaged)"
                )
        try:
            self._entries = {(x["layer"], x["expert"]): x["tensors"] for x in index["experts"]}
        except (KeyError, TypeError):
            raise StoreError(
                f"{ipath}: an 'experts' entry lacks its layer, expert or tensors (damaged)"
            ) from None
        self.experts_per_layer = _experts_per_layer(index, ipath)
        missing = [
            (li, e)
            for li, n in enumerate(self.experts_per_layer)
            for e in range(n)
            if (li, e) not in self._entries
        ]
        if missing or len(self._entries) != sum(self.experts_per_layer):
            if missing:
                what = f"no entry for layer {missing[0][0]} expert {missing[0][1]}"
            else:
                what = f"{len(self._entries)} entries for {sum(self.experts_per_layer)} experts"
            raise StoreError(f"{ipath}: incomplete or inconsistent index ({what})")
        size = self.path.stat().st_size
        if size != index["pack_bytes"]:
            cut = next((w for w, ref in self._segments() if ref["offset"] + ref["size"] > size), "")
            raise StoreError(
                f"{self.path}: truncated or altered ({size} bytes, {INDEX_FILE} says "
                f"{index['pack_bytes']})" + (f"; first segment cut: {cut}" if cut else "")
            )
        self.limiter = (
            BandwidthLimiter(storage_mbps, latency_ms) if storage_mbps is not None else None
        )
        self._fd = os.open(self.path, os.O_RDONLY)
        self.uncached = uncached
        if uncached:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.drop_page_cache()
        self.bytes_read = 0
        self.read_s = 0.0
        self._stat_lock = threading.Lock()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def num_layers(self) -> int:
        return self.index["num_layers"]

    @property
    def num_experts(self) -> int:
        """The largest expert count of any layer (see :attr:`experts_per_layer`)."""
        return max(self.experts_per_layer)

    def tensors(self, layer: int, expert: int) -> dict[str, dict[str, Any]]:
        """The placed specs of one expert's tensors, by name.

        Raises:
            StoreError: the store has no such expert.
        """
        try:
            return self._entries[(layer, expert)]
        except KeyError:
            raise StoreError(
                f"{self.folder / INDEX_FILE}: no entry for layer {layer} expert {expert}"
            ) from None

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop the pack's cached pages (``POSIX_FADV_DONTNEED``)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (one ``os.pread``; throttled by the cap if set; the
        page cache dropped afterwards if ``uncached``)."""
        issued = time.perf_counter()
        data = os.pread(self._fd, size, offset)
        if self.uncached:
            self.drop_page_cache()
        if self.limiter is not None:
            self.limiter.wait(len(data), issued)
        dt = time.perf_counter() - issued
        with self._stat_lock:
            self.bytes_read += len(data)
            self.read_s += dt
        return data

    def where(self, layer: int, expert: int, name: str) -> str:
        """``"<pack>: layer l expert e tensor name"`` for error messages."""
        return f"{self.path}: layer {layer} expert {expert} tensor {name!r}"

    def read_segment(self, layer: int, expert: int, name: str, ref: dict, what: str) -> bytes:
        """A CRC-checked segment; :class:`StoreError` names the expert on failure."""
        try:
            return read_segment(self.read, ref, what)
        except TensorDecodeError as e:
            raise StoreError(f"{self.where(layer, expert, name)}: {e}") from None

    def read_segments(
        self,
        layer: int,
        expert: int,
        name: str,
        refs: list[dict],
        what: list[str],
        check: bool = True,
    ) -> list[bytes]:
        """Segments that lie back to back in the pack, fetched as one request (as a tensor's
        exponent chunks do): a storage device serves one large read faster than many small
        ones, and each request costs the reading thread a round trip. With ``check`` each is
        CRC-checked here; without, the caller checks them (``check_segment``), e.g. on
        another thread so that the reading thread can issue the next read.

        Raises:
            StoreError: a segment is short or fails its checksum (names the expert), or the
                segments are not contiguous.
        """
        if not refs:
            return []
        first = refs[0]["offset"]
        end = first
        for ref in refs:
            if ref["offset"] != end:
                raise StoreError(f"{self.where(layer, expert, name)}: segments not contiguous")
            end += ref["size"]
        span = memoryview(self.read(first, end - first))

        def sliced(offset: int, size: int) -> bytes:
            return span[offset - first : offset - first + size]

        if not check:
            return [sliced(r["offset"], r["size"]) for r in refs]
        try:
            return [read_segment(sliced, ref, w) for ref, w in zip(refs, what, strict=True)]
        except TensorDecodeError as e:
            raise StoreError(f"{self.where(layer, expert, name)}: {e}") from None

    def load_tensor(self, layer: int, expert: int, name: str, verify: bool = True):
        """Read and decode one expert tensor serially (sha256-verified)."""
        spec = self.tensors(layer, expert).get(name)
        if spec is None:
            raise StoreError(f"{self.where(layer, expert, name)}: not in the store")
        try:
            return decode_tensor(spec, self.read, verify)
        except TensorDecodeError as e:
            raise StoreError(f"{self.where(layer, expert, name)}: {e}") from None

    def _segments(self):
        """``(where, ref)`` of every segment in the index, in pack order (``where`` names the
        layer, expert, tensor and segment)."""
        out = []
        for (layer, expert), tensors in self._entries.items():
            for name, spec in tensors.items():
                refs = [("raw bytes", spec["raw"])] if spec["layout"] == "raw" else [
                    *((f"exponent chunk {i}", r) for i, r in enumerate(spec["chunks"])),
                    ("sign-mantissa bytes", spec["sm"]),
                ]  # fmt: skip
                out += [(f"{self.where(layer, expert, name)}: {w}", r) for w, r in refs]
        return sorted(out, key=lambda x: x[1]["offset"])

    def verify(self) -> None:
        """CRC-check every segment of the pack (one unthrottled pass over the file), so that a
        damaged or foreign pack fails before anything is generated.

        Raises:
            StoreError: names the first bad segment and how many are bad; when none matches,
                says the pack does not belong to this index.
        """
        segs = self._segments()
        bad = [
            w
            for w, ref in segs
            if zlib.crc32(os.pread(self._fd, ref["size"], ref["offset"])) != ref["crc32"]
        ]
        if bad and len(bad) == len(segs):
            raise StoreError(
                f"{self.path}: no segment matches {INDEX_FILE} (a pack from another store?)"
            )
        if bad:
            raise StoreError(
                f"{bad[0]}: checksum mismatch (corrupt; {len(bad)} of {len(segs)} segments bad)"
            )
