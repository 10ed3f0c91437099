"""An edited model's state as a folder: ``edit.json`` (format, the base model, the config,
the requests applied, how many of the stream were applied, a checksum) and
``edits.safetensors`` (the edit bank's buffers; FT-L: the edited layer's weight).

The base model is not copied: :func:`load_edits` applies the state to a fresh load of it.
A stream that stopped part-way is written with ``complete: false`` and refused on load
(unless ``allow_partial``), so a partially applied stream never passes for a complete one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from moelab.errors import InvalidValueError, UserError
from moelab.methods.editing.config import EditConfig
from moelab.methods.editing.editor import Editor
from moelab.methods.editing.requests import EditRequest
from moelab.utils.atomic import atomic_write_bytes, atomic_write_json, write_folder_atomically
from moelab.utils.jsonfile import read_json

FORMAT = "moelab.edit/1"
STATE_FILE = "edit.json"
TENSORS_FILE = "edits.safetensors"


class EditStateError(UserError, ValueError):
    """An edit folder is missing, of another format, corrupt, partial, or does not fit the
    model it is applied to."""


def is_edit_folder(folder: str | Path) -> bool:
    """True when ``folder`` holds an ``edit.json`` (written by :func:`save_edits`)."""
    return (Path(folder) / STATE_FILE).is_file()


def _tensors(editor: Editor) -> dict[str, torch.Tensor]:
    if editor.bank is None:
        return {"weight": editor.original.weight.detach().contiguous()}
    return {k: v.detach().contiguous() for k, v in editor.bank.named_buffers()}


def save_edits(editor: Editor, out: str | Path, base: str, *, overwrite: bool = False) -> Path:
    """Write the edits ``editor`` holds to the folder ``out`` atomically; ``base`` names the
    model they apply to (a pretrained name or a folder path, as the CLI takes it).
    ``complete`` is true only when every request of the streams given to
    :meth:`Editor.apply_stream` was applied."""
    tensors = _tensors(editor)
    blob = save_safetensors(tensors)
    meta = {
        "format": FORMAT,
        "base": base,
        "config": dataclasses.asdict(editor.config),
        "applied": editor.num_edits,
        "stream_length": editor.stream_length,
        "complete": editor.num_edits == editor.stream_length,
        "requests": [{"prompt": r.prompt, "target": r.target, **r.meta} for r in editor.requests],
        "params_per_edit": editor.params_per_edit,
        "sha256": hashlib.sha256(blob).hexdigest(),
    }

    def fill(tmp: Path) -> None:
        atomic_write_bytes(tmp / TENSORS_FILE, blob)
        atomic_write_json(tmp / STATE_FILE, meta)

    write_folder_atomically(out, fill, overwrite, known_outputs=(STATE_FILE, TENSORS_FILE))
    return Path(out)


def read_edit_state(folder: str | Path) -> dict:
    """The checked ``edit.json`` of ``folder``.

    Raises:
        EditStateError: no such file or another format.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise EditStateError(f"{folder}: no {STATE_FILE} (not a `moelab edit apply` output)")
    meta = read_json(path, EditStateError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise EditStateError(f"{path}: not a {FORMAT} file")
    return meta


def load_edits(folder: str | Path, model: nn.Module, *, allow_partial: bool = False) -> Editor:
    """Apply the edits saved in ``folder`` to ``model`` (a fresh load of their base model);
    returns the :class:`Editor` holding them (its :meth:`~Editor.restore` undoes them).

    Raises:
        EditStateError: a bad folder or checksum, a partially applied stream (unless
            ``allow_partial``), or tensors that do not fit the model's layer.
    """
    folder = Path(folder)
    meta = read_edit_state(folder)
    if not meta.get("complete") and not allow_partial:
        raise EditStateError(
            f"{folder}: a partially applied stream ({meta.get('applied')} of "
            f"{meta.get('stream_length')} edits); apply the stream again"
        )
    try:
        blob = (folder / TENSORS_FILE).read_bytes()
    except OSError:
        raise EditStateError(f"{folder}: no readable {TENSORS_FILE}") from None
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise EditStateError(f"{folder / TENSORS_FILE}: checksum mismatch (corrupt or replaced)")
    fields = {f.name for f in dataclasses.fields(EditConfig)}
    raw = meta.get("config", {})
    if not isinstance(raw, dict) or set(raw) - fields:
        raise EditStateError(f"{folder / STATE_FILE}: unknown config fields")
    try:
        config = EditConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except InvalidValueError as e:
        raise EditStateError(f"{folder / STATE_FILE}: {e}") from None
    tensors = load_safetensors(blob)
    editor = Editor(model, config)
    current = _tensors(editor)
    fits = set(tensors) == set(current) and all(
        tensors[k].dim() == current[k].dim()
        and tensors[k].shape[editor.bank is not None :]
        == current[k].shape[editor.bank is not None :]
        for k in current
    )
    if not fits:
        editor.restore()
        raise EditStateError(
            f"{folder / TENSORS_FILE}: the saved edits do not fit {config.layer!r}"
        )
    with torch.no_grad():
        if editor.bank is None:
            editor.original.weight.copy_(tensors["weight"])
        else:
            for name, value in tensors.items():
                setattr(editor.bank, name, value.to(current[name].device))
            editor.site.reset_telemetry()
    requests = [
        EditRequest(
            r["prompt"], r["target"], {k: v for k, v in r.items() if k not in ("prompt", "target")}
        )
        for r in meta.get("requests", [])
    ]
    editor.requests[:] = requests
    editor.applied = int(meta.get("applied", len(requests)))
    editor.stream_length = int(meta.get("stream_length", len(requests)))
    return editor
