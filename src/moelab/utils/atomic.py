"""Atomic file writes: write a temp file in the target folder, fsync, ``os.replace``, fsync the
folder. A crash leaves either the old file or the new one, never a partial file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries to disk (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` to fill a temp file, then move it onto ``path`` atomically.

    The parent folder is created if missing. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; give a normal file's mode
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, **dumps_kwargs: Any) -> Path:
    """Write ``obj`` as indented JSON (plus a newline) to ``path`` atomically."""
    dumps_kwargs.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


def write_folder_atomically(
    out_dir: str | os.PathLike[str], fill: Callable[[Path], Any], overwrite: bool = False
) -> Any:
    """Create ``out_dir`` by ``fill(tmp)`` in a sibling temp folder, fsync, then rename.

    A failure leaves nothing at ``out_dir`` (or the previous folder untouched).

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty, unless ``overwrite``.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{out_dir}: exists and is not empty (pass --overwrite / overwrite=True)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~_current_umask())
    try:
        result = fill(tmp)
        for p in sorted(tmp.rglob("*"), reverse=True):  # files, then their folders
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            elif p.is_dir():
                fsync_dir(p)
        fsync_dir(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
