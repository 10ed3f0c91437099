"""Reading Hugging Face checkpoint folders and writing output folders atomically.

A checkpoint is ``config.json`` plus ``model.safetensors`` or the sharded
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``, as written by
``PreTrainedModel.save_pretrained``). ``pytorch_model.bin`` pickles are refused (they can run
code when loaded).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from moelab.interop.errors import InteropError
from moelab.utils.jsonfile import read_json as read_json_file
from moelab.utils.paths import UnsafePathError, confined

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def read_json(path: Path) -> Any:
    return read_json_file(path, InteropError)


def _load(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InteropError(f"{path}: cannot read safetensors ({e})") from e


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint in ``folder`` (single file or sharded).

    Raises:
        InteropError: no safetensors weights, an unreadable shard, a tensor in two shards,
            an index entry whose shard lacks it, or a shard name leading outside ``folder``.
    """
    index = folder / INDEX
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise InteropError(f"{index}: no 'weight_map'")
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(wm.values()), key=str):
            part = _load(_inside(folder, shard, f"{INDEX} shard"))
            for name, t in part.items():
                if name in tensors:
                    raise InteropError(f"{folder / shard}: tensor {name!r} is in two shards")
                if wm.get(name) != shard:
                    raise InteropError(
                        f"{folder / shard}: tensor {name!r} is not listed for this shard in {INDEX}"
                    )
                tensors[name] = t
        missing = sorted(set(wm) - set(tensors))
        if missing:
            raise InteropError(f"{index}: tensor(s) {missing[:8]} not found in their shards")
        return tensors
    single = folder / SAFETENSORS
    if single.is_file():
        return _load(single)
    if (folder / "pytorch_model.bin").is_file():
        raise InteropError(
            f"{folder}: only safetensors checkpoints are read (found pytorch_model.bin; "
            "re-save it with save_pretrained(safe_serialization=True))"
        )
    raise InteropError(f"{folder}: no {SAFETENSORS} or {INDEX}")


def _inside(folder: Path, name: object, what: str) -> Path:
    try:
        return confined(folder, name, what=what, within=hub_repository(folder))
    except UnsafePathError as e:
        raise InteropError(str(e)) from e


def hub_repository(folder: Path) -> Path | None:
    """For a Hugging Face hub cache snapshot (``models--ORG--NAME/snapshots/REVISION``, whose
    files are symlinks into ``models--ORG--NAME/blobs``), the repository folder its files
    may lead into; None for any other folder (its files must stay inside it)."""
    folder = Path(folder).absolute()
    repo = folder.parent.parent
    if (
        folder.parent.name == "snapshots"
        and repo.name.startswith(("models--", "datasets--"))
        and (repo / "blobs").is_dir()
    ):
        return repo
    return None


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer (and generation config) files present in ``src``; their names.

    Raises:
        InteropError: a tokenizer file is a symlink leading outside ``src`` (never copied).
    """
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(_inside(src, name, "tokenizer file"), dst / name)
            copied.append(name)
    return copied
