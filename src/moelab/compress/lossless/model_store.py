"""Write a model's experts to a lossless store, and read the store back.

A store folder (written atomically as a whole) holds::

    config.json        {"format_version": 1, "model": ModelConfig} (as a model folder's)
    dense.safetensors  every non-expert tensor of the state dict (embeddings, attention,
                       norms, routers, shared experts, dense FFNs), in the model's dtype
    experts.pack       the encoded expert tensors (:mod:`moelab.compress.lossless.store`)
    store.json         the index; it also records the model fingerprint and the sha256 of
                       dense.safetensors, so a pack from another model is refused
    profile.json       optional routing trace ``counts [P, L, E]`` for the cache planner
    tokenizer files, and run.json when the source was a run folder (for ``moelab eval``);
                       the index records their sha256 (:data:`RECORDED_FILES`)

Expert ``e`` of MoE layer ``l`` stores ``w_gate_up[e] [D, 2F]`` (or ``w_up[e] [D, F]``) and
``w_down[e] [F, D]``: the slices of the bank's stacked tensors, bit for bit. Layers may hold
different numbers of experts (``E_l``, a pruned model's ``experts_per_layer``); the index records
them, and routing traces are ``[P, L, max E_l]`` with zero counts past a layer's experts.

A store is reported written only after it has been read back: the index must list every expert
of every layer and every segment must pass its CRC (:func:`compress_model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moelab.compress.lossless.bitfield import ELEMENT_BYTES, SM_BYTES, SUPPORTED, tensor_bits
from moelab.compress.lossless.store import (
    INDEX_FILE,
    PACK_FILE,
    ExpertPack,
    PackWriter,
    StoreError,
    is_store,
    write_index,
)
from moelab.compress.lossless.tensor_codec import (
    CODEC_CHOICES,
    DEFAULT_CHUNKS,
    decode_tensor,
    encode_tensor,
    memory_read,
)
from moelab.core.config import GATED_ACTIVATIONS
from moelab.core.layer import MoELayer
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.config import ModelConfig
from moelab.models.io import CONFIG_FILE, FORMAT_VERSION, load_config, sha256_file
from moelab.models.transformer import MoETransformer
from moelab.utils.atomic import atomic_write_json, write_folder_atomically
from moelab.utils.jsonfile import read_json

DENSE_FILE = "dense.safetensors"
RECORDED_FILES = ("tokenizer_meta.json", "tokenizer.json", "run.json")
"""Files beside the experts whose SHA-256 the index records (format 4): they change how the
model's text is read, so a swapped one must fail at open rather than change scores silently."""
PROFILE_FILE = "profile.json"
MAX_CHUNKS = 64
"""Most exponent chunks per tensor: each is one decode task and one index entry, so more
only adds scheduling and index size (the authors use 5 for many cores)."""
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32}  # fmt: skip


def model_fingerprint(model_dict: dict[str, Any], dtype: str) -> str:
    """sha256 of the model config as written to config.json (canonical JSON) plus the expert
    dtype. Hashing the stored dict, not a re-serialised :class:`ModelConfig`, keeps stores
    valid when later moelab versions add config fields with defaults."""
    blob = json.dumps({"model": model_dict, "dtype": dtype}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def moe_layers(model: MoETransformer) -> list[tuple[int, MoELayer]]:
    """``[(block index, MoELayer)]`` of every MoE block, in order."""
    return [(i, b.ffn) for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoELayer)]


def expert_tensor_names(cfg: ModelConfig) -> tuple[str, str]:
    """The stored names of an expert's two tensors (``w_gate_up``/``w_up``, ``w_down``)."""
    if cfg.moe is None:
        raise InvalidValueError("model: has no MoE layers (a dense model has no experts to store)")
    first = "w_gate_up" if cfg.moe.experts.activation in GATED_ACTIVATIONS else "w_up"
    return first, "w_down"


def _is_expert_key(name: str, blocks: set[int], names: tuple[str, str]) -> bool:
    parts = name.split(".")
    return (
        len(parts) == 5
        and parts[0] == "blocks"
        and int(parts[1]) in blocks
        and parts[2:4] == ["ffn", "experts"]
        and parts[4] in names
    )


@dataclass
class KindStats:
    """Size accounting of one tensor kind (``w_gate_up``, ``w_down``) over all experts.

    Attributes (bytes unless noted): ``elements``; ``original`` (bf16/fp32 bytes);
    ``exponent`` (coded exponent chunks); ``sign_mantissa``; ``entropy_bound`` (Σ N·H/8 over
    tensors); ``codecs`` (codec → tensor count).
    """

    elements: int = 0
    original: int = 0
    exponent: int = 0
    sign_mantissa: int = 0
    entropy_bound: float = 0.0
    codecs: dict[str, int] = field(default_factory=dict)

    @property
    def stored(self) -> int:
        return self.exponent + self.sign_mantissa

    def add(self, spec: dict[str, Any], n_bytes: int) -> None:
        self.elements += spec["numel"]
        self.original += spec["numel"] * ELEMENT_BYTES[spec["dtype"]]
        self.codecs[spec["codec"]] = self.codecs.get(spec["codec"], 0) + 1
        if spec["layout"] == "raw":
            self.sign_mantissa += n_bytes
            return
        sm = spec["sm"]["size"]
        self.sign_mantissa += sm
        self.exponent += n_bytes - sm
        self.entropy_bound += spec["numel"] * spec["entropy_bits"] / 8


@dataclass
class StoreReport:
    """What :func:`compress_model` wrote: per-kind sizes, dense bytes, seconds."""

    folder: Path
    kinds: dict[str, KindStats]
    dense_bytes: int
    seconds: float
    dtype: str
    codec: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "dtype": self.dtype,
            "codec": self.codec,
            "dense_bytes": self.dense_bytes,
            "seconds": self.seconds,
            "kinds": {k: {**v.__dict__, "stored": v.stored} for k, v in self.kinds.items()},
        }


def _check_model(model: MoETransformer, dtype: str | None) -> torch.dtype:
    if not isinstance(model, MoETransformer):
        raise InvalidTypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    layers = moe_layers(model)
    if not layers:
        raise InvalidValueError("model: has no MoE layer (nothing to offload)")
    ex = model.cfg.moe.experts
    if getattr(ex, "bias", False) or getattr(ex, "lora_rank", 0):
        raise InvalidValueError(
            "model: experts with biases or LoRA adapters are not supported by the lossless "
            "store (merge the adapters first: moelab merge-lora)"
        )
    if dtype is not None:
        if dtype not in DTYPES:
            raise InvalidValueError(f"dtype: must be bf16 or fp32, got {dtype!r}")
        return DTYPES[dtype]
    have = layers[0][1].experts.w_down.dtype
    if have not in SUPPORTED:
        raise InvalidValueError(
            f"model: experts are {have}; the lossless codec supports bfloat16 and float32 "
            "(pass --dtype bf16 to cast)"
        )
    return have


def compress_model(
    model: MoETransformer,
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    codec: str = "zstd",
    chunks: int = DEFAULT_CHUNKS,
    trace: np.ndarray | None = None,
    save_extras: Callable[[Path], None] | None = None,
    overwrite: bool = False,
    on_expert: Callable[[], None] | None = None,
) -> StoreReport:
    """Write ``model``'s experts to a lossless store at ``out`` (atomically).

    Args:
        model: a :class:`MoETransformer` whose experts are bf16 or fp32 (or any float dtype
            with ``dtype`` set; the whole model is then cast).
        dtype: ``"bf16"``/``"fp32"`` to cast the model first; None keeps its dtype.
        codec: ``"zstd"`` (default: ZSTD level 1, the authors' ``utils/config.py`` default;
            releases the GIL, so the scheduler's decode threads run in parallel), ``"lz4hc"``
            (LZ4HC level 9, the codec of the authors' evaluation, run there with 3 chunks;
            needs the ``lz4`` package) or ``"lz4"`` (LZ4 fast), ``"ans"`` (``constriction``: at the
            entropy bound, but about 25× slower to decode and holding the GIL, measured on
            1 M exponents), ``"best"`` (the smaller per tensor) or ``"raw"`` (uncompressed).
        chunks: exponent chunks per tensor, 1 to :data:`MAX_CHUNKS`.
        trace: optional routing counts ``[P, L, E]`` saved as ``profile.json``.
        save_extras: called with the temp folder to add files (tokenizer, run.json).
        overwrite: replace an existing non-empty ``out``.
        on_expert: progress callback, once per expert written.
    Raises:
        ValueError: no MoE layer, unsupported expert dtype, bad codec/chunks/trace.
        FileExistsError: ``out`` is not empty and not ``overwrite``.
    """
    target = _check_model(model, dtype)
    if codec not in CODEC_CHOICES:
        raise InvalidValueError(f"codec: must be one of {', '.join(CODEC_CHOICES)}; got {codec!r}")
    if not 1 <= chunks <= MAX_CHUNKS:
        raise InvalidValueError(f"chunks: must be in [1, {MAX_CHUNKS}], got {chunks}")
    if model.embed.weight.dtype != target:
        model = model.to(target)  # nn.Module.to casts in place; callers pass a loaded copy
    layers = moe_layers(model)
    per_layer = [layer.experts.num_experts for _, layer in layers]
    if trace is not None:
        trace = np.asarray(trace)
        problem = trace_problem(trace, per_layer)
        if problem:
            raise InvalidValueError(f"trace: {problem}")
    cfg = model.cfg
    names = expert_tensor_names(cfg)
    dname = SUPPORTED[target]
    t0 = time.perf_counter()

    def fill(tmp: Path) -> StoreReport:
        kinds = {n: KindStats() for n in names}
        state = model.state_dict()
        if cfg.tie_embeddings:
            state.pop("lm_head.weight", None)
        blocks = {i for i, _ in layers}
        dense = {
            k: v.detach().contiguous().cpu()
            for k, v in state.items()
            if not _is_expert_key(k, blocks, names)
        }
        save_file(dense, str(tmp / DENSE_FILE), metadata={"format_version": "1"})
        atomic_write_json(
            tmp / CONFIG_FILE, {"format_version": FORMAT_VERSION, "model": cfg.to_dict()},
            sort_keys=True,
        )  # fmt: skip
        entries = []
        with open(tmp / PACK_FILE, "wb") as f:
            writer = PackWriter(f)
            for li, (_, layer) in enumerate(layers):
                bank = layer.experts
                stacked = {names[0]: bank.w_in.detach(), names[1]: bank.w_down.detach()}
                for e in range(per_layer[li]):
                    specs = {}
                    for n, w in stacked.items():
                        enc = encode_tensor(w[e], codec, chunks)
                        check = decode_tensor(enc.place(0), memory_read(b"".join(enc.segments)))
                        if not np.array_equal(tensor_bits(check), tensor_bits(w[e])):
                            raise RuntimeError(f"lossless codec is not bit-exact on {n}[{e}]")
                        specs[n] = writer.add(enc)
                        kinds[n].add(specs[n], enc.stored_bytes)
                    entries.append({"layer": li, "expert": e, "tensors": specs})
                    if on_expert is not None:
                        on_expert()
        if save_extras is not None:
            save_extras(tmp)
        files = {n: sha256_file(tmp / n) for n in RECORDED_FILES if (tmp / n).is_file()}
        dense_sha = sha256_file(tmp / DENSE_FILE)
        profile = {}
        if trace is not None:
            atomic_write_json(tmp / PROFILE_FILE, {"counts": trace.astype(int).tolist()})
            profile["profile_sha256"] = sha256_file(tmp / PROFILE_FILE)
        write_index(
            tmp,
            {
                "pack": PACK_FILE,
                "pack_bytes": writer.offset,
                "model_fingerprint": model_fingerprint(
                    read_json(tmp / CONFIG_FILE, StoreError)["model"], dname
                ),
                "dense_sha256": dense_sha,
                "dtype": dname,
                "codec": codec,
                "chunks": chunks,
                "num_layers": len(layers),
                "num_experts": max(per_layer),
                "experts_per_layer": per_layer,
                "top_k": cfg.moe.router.top_k,
                "block_of_layer": [i for i, _ in layers],
                "experts": entries,
                "files": files,
                **profile,
            },
        )
        check_written(tmp, per_layer, names)
        return StoreReport(
            Path(out), kinds, (tmp / DENSE_FILE).stat().st_size, time.perf_counter() - t0,
            dname, codec,
        )  # fmt: skip

    return write_folder_atomically(out, fill, overwrite=overwrite)


def trace_problem(trace: np.ndarray, experts_per_layer: list[int]) -> str | None:
    """What is wrong with a routing trace for layers of ``experts_per_layer`` experts (None
    when it fits): it must be non-negative counts ``[P, L, max E_l]``, zero past each layer's
    experts."""
    L, E = len(experts_per_layer), max(experts_per_layer)
    if trace.ndim != 3 or trace.shape[1:] != (L, E) or (trace < 0).any():
        return f"expected non-negative counts [P, {L}, {E}], got shape {trace.shape}"
    for li, n in enumerate(experts_per_layer):
        if trace[:, li, n:].any():
            return f"layer {li} has {n} experts but counts tokens for expert {n} or above"
    return None


def check_written(folder: Path, experts_per_layer: list[int], names: tuple[str, ...]) -> None:
    """Read a just-written store back: the index must list every expert of every layer with
    every tensor, and every segment must pass its CRC. Raises RuntimeError otherwise (the
    writer is at fault, and the folder is then never moved into place)."""
    pack = None
    try:
        pack = ExpertPack(folder)
        if pack.experts_per_layer != list(experts_per_layer):
            raise RuntimeError(
                f"store: index lists {pack.experts_per_layer} experts per layer, the model has "
                f"{list(experts_per_layer)}"
            )
        for li, n in enumerate(experts_per_layer):
            for e in range(n):
                if set(pack.tensors(li, e)) != set(names):
                    raise RuntimeError(f"store: layer {li} expert {e} lacks {names}")
        pack.verify()
    except StoreError as e:
        raise RuntimeError(f"store: written store fails to read back ({e})") from e
    finally:
        if pack is not None:
            pack.close()


def copy_run_files(source: Path) -> Callable[[Path], None]:
    """A ``save_extras`` that copies the tokenizer files and run.json of ``source``."""

    def copy(tmp: Path) -> None:
        for name in RECORDED_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)

    return copy


# ------------------------------------------------------------------------------ reading
@dataclass
class OpenStore:
    """A verified store: config, pack reader, dense tensors and optional trace."""

    folder: Path
    cfg: ModelConfig
    pack: ExpertPack
    dense: dict[str, torch.Tensor]
    trace: np.ndarray | None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.pack.index["dtype"]]

    @property
    def experts_per_layer(self) -> list[int]:
        """``[E_l]``: each MoE layer's expert count, in depth order."""
        return self.pack.experts_per_layer

    def expert_bytes(self) -> tuple[int, int]:
        """``(full, sign_mantissa)`` bytes of one expert (the largest one)."""
        full = sm = 0
        for entry in self.pack.index["experts"]:
            n = sum(s["numel"] for s in entry["tensors"].values())
            d = self.pack.index["dtype"]
            full = max(full, n * ELEMENT_BYTES[d])
            sm = max(sm, n * SM_BYTES[d])
        return full, sm


def open_store(
    folder: str | os.PathLike[str],
    storage_mbps: float | None = None,
    *,
    latency_ms: float = 0.0,
    uncached: bool = False,
) -> OpenStore:
    """Open and check a store folder (index, pack size, fingerprint, dense checksum).
    ``storage_mbps``, ``latency_ms`` and ``uncached`` set the pack's storage regime
    (:class:`moelab.compress.lossless.store.ExpertPack`).

    Raises:
        StoreError: missing files, truncated pack, a pack/index from another model, or a
            corrupt dense.safetensors — naming the file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise StoreError(f"{folder}: not a store folder")
    if not is_store(folder):
        raise StoreError(
            f"{folder / INDEX_FILE}: missing (write a store with: moelab compress RUN --lossless --out DIR)"
        )
    cfg = load_config(folder)
    pack = ExpertPack(folder, storage_mbps, latency_ms=latency_ms, uncached=uncached)
    idx = pack.index
    stored = read_json(folder / CONFIG_FILE, StoreError).get("model", {})
    if idx.get("model_fingerprint") != model_fingerprint(stored, idx.get("dtype", "")):
        raise StoreError(
            f"{folder / INDEX_FILE}: the expert store belongs to another model "
            f"(its fingerprint does not match {folder / CONFIG_FILE})"
        )
    want = [
        cfg.moe_config(i).router.num_experts for i in range(cfg.n_layers) if cfg.is_moe_layer(i)
    ]
    if pack.experts_per_layer != want:
        raise StoreError(
            f"{folder / INDEX_FILE}: lists {pack.experts_per_layer} experts per layer, "
            f"{folder / CONFIG_FILE} describes {want}"
        )
    dpath = folder / DENSE_FILE
    if not dpath.is_file():
        raise StoreError(f"{dpath}: missing")
    if sha256_file(dpath) != idx.get("dense_sha256"):
        raise StoreError(f"{dpath}: sha256 mismatch (corrupt, or from another model)")
    try:
        dense = load_file(str(dpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise StoreError(f"{dpath}: cannot read safetensors ({e})") from e
    _check_recorded_files(folder, idx)
    return OpenStore(folder, cfg, pack, dense, _read_profile(folder, pack))


def _check_recorded_files(folder: Path, idx: dict[str, Any]) -> None:
    """The tokenizer files and run.json are the ones written with the store (format 4).

    Raises:
        StoreError: a recorded file is missing or altered, or one of :data:`RECORDED_FILES`
            is present but was not written with the store (added or swapped in later).
    """
    if idx.get("format_version", 1) < 4:
        return  # earlier stores recorded none
    recorded = idx.get("files")
    if not isinstance(recorded, dict):
        raise StoreError(f"{folder / INDEX_FILE}: 'files' must map file names to sha256")
    for name in RECORDED_FILES:
        path = folder / name
        if name not in recorded:
            if path.exists():
                raise StoreError(
                    f"{path}: not written with the store (store.json records no {name})"
                )
            continue
        if not path.is_file() or sha256_file(path) != recorded[name]:
            raise StoreError(f"{path}: missing or altered (store.json records its sha256)")


def _read_profile(folder: Path, pack: ExpertPack) -> np.ndarray | None:
    """The routing profile ``[P, L, max E_l]`` the index lists (its sha256 checked), or None.

    Raises:
        StoreError: the listed profile is missing, altered or not such counts (see
            :func:`trace_problem`).
    """
    idx = pack.index
    path = folder / PROFILE_FILE
    want = idx.get("profile_sha256")
    if want is None:  # format 1 stores list none; their profile is read unchecked
        if not path.is_file() or idx.get("format_version", 1) >= 2:
            return None
    elif not path.is_file() or sha256_file(path) != want:
        raise StoreError(f"{path}: missing or altered (store.json records its sha256)")
    try:
        trace = np.asarray(read_json(path, StoreError)["counts"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path}: not a routing profile ({e})") from None
    problem = trace_problem(trace, pack.experts_per_layer)
    if problem:
        raise StoreError(f"{path}: {problem}")
    return trace


@contextlib.contextmanager
def _skip_init():
    """Make ``torch.nn.init``'s random fills no-ops while a model is built on the meta device
    (every value is replaced by stored weights; the meta-tensor fills would only cost
    seconds of decomposition set-up), like transformers' ``no_init_weights``."""
    names = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "xavier_uniform_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def skeleton_model(
    store: OpenStore, bank_factory: Callable[[int, MoELayer], torch.nn.Module] | None
) -> MoETransformer:
    """A :class:`MoETransformer` with the store's dense weights and, per MoE layer, either the
    expert bank made by ``bank_factory(layer_index, layer)`` or (None) the decompressed experts.

    No expert weights are allocated when a factory is given (the model is built on the meta
    device and the dense tensors are assigned).
    """
    cfg = store.cfg
    with _skip_init(), torch.device("meta"):
        model = MoETransformer(cfg)
    names = expert_tensor_names(cfg)
    for li, (_, layer) in enumerate(moe_layers(model)):
        if bank_factory is not None:
            layer.experts = bank_factory(li, layer)
            continue
        E = layer.experts.num_experts
        for n in names:
            w = torch.stack([store.pack.load_tensor(li, e, n) for e in range(E)])
            setattr(layer.experts, n, torch.nn.Parameter(w, requires_grad=True))
    missing, unexpected = model.load_state_dict(store.dense, strict=False, assign=True)
    bad = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if bank_factory is None:
        bad = [m for m in bad if ".ffn.experts." not in m]
    if bad or unexpected:
        raise StoreError(
            f"{store.folder / DENSE_FILE}: tensors do not match the config "
            f"(missing {sorted(bad)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise StoreError(f"{store.folder}: no weights for {leftover[:3]}")
    return model.eval()


def decompress_model(folder: str | os.PathLike[str]) -> MoETransformer:
    """The whole model in memory, every expert decoded from the store (bit-exact)."""
    return skeleton_model(open_store(folder), None)
