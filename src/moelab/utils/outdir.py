"""Output-folder safety for every command that writes a folder (convert, upcycle, analyze,
and new ones such as prune/quant/serve exports): :func:`check_output_folder`.

Rules (each refusal raises :class:`OutputFolderError`, a user error whose one-line
message names the folder and the fix):

1. The output must not be an input, lie inside an input folder, or contain an input
   (paths compared after resolving symlinks), whatever ``overwrite`` says. Replacing a folder
   that holds what is being read destroys the source.
2. The output must not be a symbolic link or an existing non-folder.
3. An existing non-empty output needs ``overwrite=True``.
4. Even with ``overwrite``, only a folder moelab wrote is replaced, and only when it holds
   nothing else: every folder written by :func:`moelab.utils.atomic.write_folder_atomically`
   carries a marker file (:data:`MARKER`) listing the files it wrote; a folder without the
   marker, or with any file the marker does not list, is refused (its foreign files are named).
   Our choice: refusing rather than keeping the foreign files, so a replaced folder is always
   exactly the new output. A folder without the marker (written before moelab had one)
   counts as moelab's when each of its top-level entries is one of ``known_outputs``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from moelab.errors import InvalidValueError

MARKER = ".moelab-output.json"
"""Marker file in every folder moelab writes as a whole: ``{"files": [relative paths]}``."""


class OutputFolderError(InvalidValueError):
    """An output folder would overwrite an input or files moelab did not write."""


class OutputExistsError(OutputFolderError, FileExistsError):
    """The output folder exists and is not empty, and replacing it was not allowed."""


def list_files(folder: Path) -> list[str]:
    """Relative paths of every file and link under ``folder`` (not following links), sorted."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            out.append((rel / name).as_posix())
    return sorted(out)


def write_marker(folder: Path) -> None:
    """Record every file now under ``folder`` as written by moelab (the marker itself too)."""
    files = sorted({*list_files(folder), MARKER})
    (folder / MARKER).write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")


def _foreign_files(folder: Path) -> list[str] | None:
    """Files under ``folder`` its marker does not list; None when there is no valid marker."""
    try:
        listed = json.loads((folder / MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(listed, list):
        return None
    return [f for f in list_files(folder) if f not in set(listed)]


def _overlap(out: Path, inp: Path) -> str | None:
    o, i = out.resolve(), inp.resolve()
    if o == i:
        return "is"
    if o in i.parents:
        return "contains"
    if i in o.parents:
        return "lies inside"
    return None


def check_output_folder(
    out: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
    flag: str | None = "--overwrite",
    known_outputs: Iterable[str] = (),
) -> Path:
    """Check that writing the folder ``out`` as a whole can lose nothing (see module rules).

    Call it before any expensive work, and again (cheaply) right before the swap; the atomic
    writer :func:`moelab.utils.atomic.write_folder_atomically` does the second call itself.

    Args:
        out: the output folder (may not exist yet).
        inputs: every file or folder the command reads (model folder, calibration file...).
        overwrite: the user allowed replacing a non-empty ``out`` written by moelab.
        flag: the CLI flag that sets ``overwrite``, for the message (``--force``...); None
            for a command that never replaces a folder.
        known_outputs: top-level names the command writes; a marker-less folder holding
            only these is treated as an earlier output of the command.
    Returns:
        ``Path(out)``.
    Raises:
        OutputFolderError: rules 1-4 of the module docstring (:class:`OutputExistsError`,
            also a ``FileExistsError``, for rule 3).
    """
    out = Path(out)
    for inp in inputs:
        rel = _overlap(out, Path(inp))
        if rel is not None:
            raise OutputFolderError(
                f"{out}: the output {rel} the input {inp}; write the output somewhere else"
            )
    if out.is_symlink():
        raise OutputFolderError(f"{out}: is a symbolic link; give a real folder as the output")
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is not a folder")
    if not out.exists() or not any(out.iterdir()):
        return out
    if not overwrite:
        fix = f"pass {flag} to replace it" if flag else "choose a new or empty folder"
        raise OutputExistsError(f"{out}: exists and is not empty ({fix})")
    foreign = _foreign_files(out)
    known = set(known_outputs)
    if foreign is None and known and all(p.name in known for p in out.iterdir()):
        foreign = []
    if foreign is None:
        raise OutputFolderError(
            f"{out}: not written by moelab (no {MARKER}); refusing to replace it even with "
            f"{flag}: remove it yourself or choose another folder"
        )
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise OutputFolderError(
            f"{out}: holds files moelab did not write ({shown}); refusing to replace it even "
            f"with {flag}: move them away or choose another folder"
        )
    return out
