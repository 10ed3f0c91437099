"""Save and load a model folder (config + safetensors weights + checksum manifest).

Folder layout (``FORMAT_VERSION = 1``)::

    config.json        {"format_version": 1, "model": ModelConfig.to_dict()}
    model.safetensors  every tensor of the state dict once (a tied LM head is not stored:
                       it is ``embed.weight``); metadata {"format_version": "1"}
    manifest.json      {"format_version": 1, "files": {"model.safetensors":
                        {"sha256": ..., "bytes": ...}, "config.json": {...}}}

A model whose MoE layers hold quantized expert banks adds a ``"quantization"`` section to
config.json and stores the banks' packed codes, scales and low-rank factors in the same
safetensors file (:mod:`moelab.models.quantized`); loading rebuilds the quantized banks.

Every file is written atomically (temp file in the folder, fsync, ``os.replace``, fsync of
the folder); the manifest is written last, so a crash mid-save leaves a folder whose
checksum does not verify rather than a silently mixed one. Loading verifies the format
version, the checksums and the exact tensor names and shapes, and raises
:class:`CheckpointError` naming the file or tensor otherwise.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moelab.core.experts.quantized import QuantizedExpertBank
from moelab.core.experts.segmented import SegmentedExpertBank
from moelab.errors import UserError
from moelab.models.adapters import ADAPTER_TYPES
from moelab.models.config import ModelConfig
from moelab.models.quantized import (
    quantization_section,
    quantized_structure,
    read_dense,
    read_quantization,
)
from moelab.models.quantized_linear import QuantizedLinear
from moelab.models.transformer import MoETransformer
from moelab.utils.atomic import atomic_write, atomic_write_json, ensure_free_space
from moelab.utils.jsonfile import read_json
from moelab.utils.paths import UnsafePathError, confined

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


class CheckpointError(UserError, ValueError):
    """A model folder cannot be saved or loaded; the message names the file or tensor."""


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj, sort_keys=True)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stored_state(model: MoETransformer) -> dict[str, torch.Tensor]:
    """The state dict as it is stored: tied LM head dropped, tensors detached/contiguous."""
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    out = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    for k, v in out.items():  # quantized banks store their low-rank factors as float16
        if ".lowrank." in k and v.is_floating_point():
            out[k] = v.to(torch.float16)
    return out


def _check_described(model: MoETransformer, state: dict[str, torch.Tensor]) -> None:
    """Refuse a model whose tensors are not the ones ``model.cfg`` builds (load_model would
    reject the folder): grown or frozen expert segments, injected adapters, or any other
    change made to the modules after construction."""
    for name, m in model.named_modules():
        if isinstance(m, SegmentedExpertBank):
            raise CheckpointError(
                f"model: {name} holds grown or frozen expert segments, which the config cannot "
                "describe; call moelab.models.consolidate_model_experts(model) first"
            )
        if isinstance(m, ADAPTER_TYPES):
            raise CheckpointError(
                f"model: {name} is an injected {type(m).__name__}, which the config cannot "
                "describe; fold LoRA in with moelab.models.adapters.merge_adapters(model) first"
            )
    with torch.device("meta"):
        ref = MoETransformer(model.cfg)
    # quantized banks are checked by their own spec when the folder loads
    quantized = tuple(
        f"{n}."
        for n, m in model.named_modules()
        if isinstance(m, (QuantizedExpertBank, QuantizedLinear))
    )
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items() if not k.startswith(quantized)}
    for n in quantized:  # a quantized projection's weight is its codes
        want.pop(f"{n}weight", None)
        want.pop(f"{n}bias", None)
    if model.cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    state = {k: t for k, t in state.items() if not k.startswith(quantized)}
    for k, t in state.items():
        if want.get(k) != tuple(t.shape):
            got = "is not" if k not in want else f"has shape {tuple(t.shape)}, not {want[k]},"
            raise CheckpointError(
                f"model: tensor {k!r} {got} what model.cfg describes; the folder would not load"
            )
    missing = sorted(set(want) - set(state))
    if missing:
        raise CheckpointError(f"model: lacks tensor(s) {missing} that model.cfg describes")


def _read_json(path: Path) -> Any:
    return read_json(path, CheckpointError)


def _inside(folder: Path, name: Any) -> Path:
    """``folder / name``, refused (CheckpointError) when it leads outside ``folder``."""
    try:
        return confined(folder, name, what="file")
    except UnsafePathError as e:
        raise CheckpointError(str(e)) from e


def _check_version(path: Path, obj: Any) -> None:
    v = obj.get("format_version") if isinstance(obj, dict) else None
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"{path}: missing or non-integer 'format_version'")
    if v > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {v} is newer than this moelab reads ({FORMAT_VERSION}); "
            "upgrade moelab"
        )
    if v < 1:
        raise CheckpointError(f"{path}: invalid format_version {v}")


# ------------------------------------------------------------------------- public
def save_model(
    model: MoETransformer,
    folder: str | os.PathLike[str],
    *,
    extra_files: tuple[str, ...] | list[str] = (),
) -> Path:
    """Save ``model`` to ``folder`` (created if needed; existing files are replaced).

    The manifest is written last: a folder is complete exactly when ``manifest.json`` exists
    (a kill before leaves a folder that fails to load, never a mixed one).

    Args:
        model: the model.
        folder: target folder.
        extra_files: names of files already in ``folder`` (e.g. the tokenizer's) whose
            checksums the manifest also records, so that a swapped or altered file is caught
            when the folder is loaded.
    Returns:
        The folder path.
    Raises:
        DiskFullError: not enough free space for the weights (checked before writing).
        CheckpointError: an ``extra_files`` entry is missing or outside ``folder``; the
            model's tensors are not the ones its config builds (grown or frozen expert
            segments: :func:`moelab.models.consolidate_model_experts`; injected adapters:
            :func:`moelab.models.adapters.merge_adapters`), so the folder would not load.
    """
    if not isinstance(model, MoETransformer):
        raise TypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    state = _stored_state(model)
    _check_described(model, state)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ensure_free_space(folder, sum(t.numel() * t.element_size() for t in state.values()))
    for name in extra_files:
        _inside(folder, name)
    config = {"format_version": FORMAT_VERSION, "model": model.cfg.to_dict()}
    metadata = {"format_version": str(FORMAT_VERSION)}
    quant = quantization_section(model)
    if quant is not None:
        config["quantization"] = quant
        metadata["quantization_format_version"] = str(quant["format_version"])
    _write_json(folder / CONFIG_FILE, config)
    atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata=metadata))
    files = {}
    for name in (CONFIG_FILE, WEIGHTS_FILE, *extra_files):
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in extra_files)")
        files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    _write_json(folder / MANIFEST_FILE, {"format_version": FORMAT_VERSION, "files": files})
    return folder


def load_config(folder: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` stored in ``folder/config.json`` (no checksum check)."""
    path = _inside(Path(folder), CONFIG_FILE)
    obj = _read_json(path)
    _check_version(path, obj)
    if "model" not in obj:
        raise CheckpointError(f"{path}: missing 'model' section")
    try:
        return ModelConfig.from_dict(obj["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model config ({e})") from e


def verify_folder(folder: str | os.PathLike[str]) -> None:
    """Check the manifest's format version and every listed file's size and sha256.

    Raises:
        CheckpointError: naming the missing, truncated or corrupt file, or an entry that
            leads outside the folder (absolute, ``..``, or a symlink out).
    """
    folder = Path(folder)
    mpath = folder / MANIFEST_FILE
    manifest = _read_json(mpath)
    _check_version(mpath, manifest)
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS_FILE not in files:
        raise CheckpointError(f"{mpath}: no checksum entry for {WEIGHTS_FILE}")
    for name, entry in files.items():
        p = _inside(folder, name)
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {MANIFEST_FILE})")
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise CheckpointError(f"{mpath}: malformed entry for {name}")
        size = p.stat().st_size
        if "bytes" in entry and size != entry["bytes"]:
            raise CheckpointError(
                f"{p}: truncated or altered ({size} bytes, manifest says {entry['bytes']})"
            )
        if sha256_file(p) != entry["sha256"]:
            raise CheckpointError(f"{p}: sha256 checksum mismatch (file is corrupt)")


def load_model(
    folder: str | os.PathLike[str], *, device: torch.device | str | None = None
) -> MoETransformer:
    """Load a model saved by :func:`save_model`.

    The model is built from ``config.json``, cast to the dtype of the stored weights, and
    the weights are copied in bit for bit.

    Raises:
        CheckpointError: newer ``format_version``; missing, truncated or corrupt files
            (checksum); unreadable safetensors; missing or unexpected tensors; shape
            mismatches — each naming the file or tensor.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a model folder")
    cfg = load_config(folder)
    wpath = folder / WEIGHTS_FILE
    if not wpath.is_file():
        raise CheckpointError(f"{wpath}: missing")
    verify_folder(folder)
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{wpath}: cannot read safetensors ({e})") from e

    model = MoETransformer(cfg)
    quant = _read_json(folder / CONFIG_FILE).get("quantization")
    if quant is not None:
        try:
            where = str(folder / CONFIG_FILE)
            quantized_structure(model, read_quantization(quant, where), read_dense(quant, where))
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    expected = _stored_state(model)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{wpath}: missing tensor(s) {missing}")
    if extra:
        raise CheckpointError(f"{wpath}: unexpected tensor(s) {extra}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{wpath}: tensor {name!r} has shape {tuple(t.shape)}, the config needs "
                f"{tuple(expected[name].shape)}"
            )
    w = tensors["embed.weight"]
    for name, t in tensors.items():
        # weights are floating point; integer tensors only where the model keeps integers
        # (a quantized bank's codes and grid indices)
        if t.is_floating_point() != expected[name].is_floating_point():
            kind = "floating point" if expected[name].is_floating_point() else "integer"
            raise CheckpointError(
                f"{wpath}: tensor {name!r} has dtype {t.dtype}; it must be {kind} "
                f"(embed.weight is {w.dtype})"
            )
    if w.dtype != model.embed.weight.dtype:
        model = model.to(w.dtype)
    model.load_state_dict(tensors, strict=not cfg.tie_embeddings)
    tied_head = isinstance(model.lm_head, torch.nn.Linear)  # a quantized head is untied
    if cfg.tie_embeddings and tied_head and model.lm_head.weight is not model.embed.weight:
        raise CheckpointError(f"{wpath}: tied embeddings came apart while loading")
    if device is not None:
        model = model.to(device)
    return model
