"""Atomic file writes: write a temp file in the target folder, fsync, ``os.replace``, fsync the
folder. A crash leaves either the old file or the new one, never a partial file.

While a write is under way, SIGTERM interrupts it as SIGINT does (:func:`sigterm_as_interrupt`),
so the temporaries are removed on either signal; a folder write also removes the hidden
temporaries an earlier killed write (SIGKILL, a power cut) left beside its output.

A full disk (``ENOSPC``/``EDQUOT``) becomes :class:`DiskFullError`, one line naming the file,
the free space and (where the caller knows it, :func:`ensure_free_space`) the space needed;
the temp file is removed, so nothing partial is left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moelab.errors import UserError
from moelab.utils.locking import folder_lock
from moelab.utils.outdir import check_output_folder, write_marker

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class DiskFullError(UserError, OSError):
    """No space left for a write; the message names the file and the space free/needed."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return -1


def disk_full_error(
    path: str | os.PathLike[str], exc: OSError | None = None, needed: int | None = None
):
    """The :class:`DiskFullError` for a write to ``path`` (``needed`` bytes if known)."""
    path = Path(path)
    free = _free_bytes(path.parent)
    need = f"needs about {needed:,} bytes, " if needed is not None else ""
    return DiskFullError(
        errno.ENOSPC,
        f"{path}: no space left on the device ({need}{free:,} bytes free); "
        "free some space and retry (nothing was written)",
    )


LOW_SPACE = 1 << 20
"""A write that fails while fewer bytes than this are free counts as a full disk."""


def is_disk_full(exc: BaseException, folder: str | os.PathLike[str] | None = None) -> bool:
    """True when ``exc`` means the disk or quota is full.

    An ``OSError`` says so by its errno; writers that wrap the error (safetensors'
    ``SafetensorError``, torch's ``RuntimeError`` from its zip writer) are recognised by
    the OS message in their text or, given ``folder``, by fewer than :data:`LOW_SPACE` bytes
    left free there after the failure.
    """
    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _FULL
    if not isinstance(exc, Exception) or isinstance(exc, (ValueError, TypeError)):
        return False
    if "No space left on device" in str(exc) or "os error 28" in str(exc):
        return True
    return folder is not None and 0 <= _free_bytes(Path(folder)) < LOW_SPACE


def ensure_free_space(folder: str | os.PathLike[str], needed: int) -> None:
    """Refuse a write of ``needed`` bytes into ``folder`` before starting it.

    Raises:
        DiskFullError: fewer than ``needed`` bytes are free on ``folder``'s filesystem.
    """
    free = _free_bytes(Path(folder))
    if 0 <= free < needed:
        raise disk_full_error(Path(folder), needed=needed)


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


@contextlib.contextmanager
def sigterm_as_interrupt():
    """For the ``with`` block, SIGTERM raises ``KeyboardInterrupt`` as SIGINT does, so that
    cleanup code (``except BaseException`` / ``finally``) runs instead of the process dying
    with its temporaries in place. Only in the main thread, and only while SIGTERM has its
    default action (a server or the training loop that handles it keeps its own handler)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` to fill a temp file, then move it onto ``path`` atomically.

    The parent folder is created if missing. The file gets the mode a normal file gets under
    the current umask (whatever mode ``write`` created it with). A symlink at ``path`` is
    replaced, never followed. Returns ``path``.

    Raises:
        DiskFullError: the disk filled up (the temp file is removed, ``path`` is untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_as_interrupt():
        return _write_file(path, write)


def _write_file(path: Path, write: Callable[[str], Any]) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes 0600 and some writers (safetensors) recreate the file: set the mode after
        os.chmod(tmp, 0o666 & ~_current_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(e, path.parent) and not isinstance(e, DiskFullError):
            raise disk_full_error(path, e) from e
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
    """Write ``obj`` as indented JSON (plus a newline) to ``path`` atomically.

    Non-finite floats are refused (``allow_nan=False``): the file stays valid JSON.
    """
    dumps_kwargs.setdefault("indent", 2)
    dumps_kwargs.setdefault("allow_nan", False)
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


def _normalise_modes(folder: Path) -> None:
    """Give every file under ``folder`` the mode a new file gets under the umask: writers
    such as safetensors create their files 0600."""
    mode = 0o666 & ~_current_umask()
    for root, _, files in os.walk(folder):
        for name in files:
            p = Path(root) / name
            if not p.is_symlink():
                os.chmod(p, mode)


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            p = Path(root) / name
            if not p.is_symlink():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(root)


def write_folder_atomically(
    out_dir: str | os.PathLike[str],
    fill: Callable[[Path], Any],
    overwrite: bool = False,
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    flag: str | None = "--overwrite",
    known_outputs: Iterable[str] = (),
) -> Any:
    """Create ``out_dir`` by ``fill(tmp)`` in a sibling temp folder, fsync, then rename.

    The output-folder rules of :func:`moelab.utils.outdir.check_output_folder` apply (never an
    input or a folder around/inside one, never replace files moelab did not write); the
    output folder is locked (:func:`moelab.utils.locking.folder_lock`) while it is written, and
    the written folder carries the :data:`moelab.utils.outdir.MARKER` listing its files.
    A failure, SIGINT or SIGTERM leaves nothing at ``out_dir`` (or the previous folder
    untouched); a SIGKILL at worst a hidden ``.NAME.*.tmp`` sibling, which the next write of
    ``out_dir`` removes.

    Args:
        out_dir: the folder to write.
        fill: writes the content into the temp folder it is given; its result is returned.
        overwrite: replace a non-empty ``out_dir`` that moelab wrote.
        inputs: the files/folders the command reads (refused as or around the output).
        flag: the CLI flag behind ``overwrite``, for messages.
        known_outputs: see :func:`~moelab.utils.outdir.check_output_folder`.
    Raises:
        OutputFolderError: see :func:`~moelab.utils.outdir.check_output_folder`
            (``OutputExistsError``, a ``FileExistsError``, for a non-empty ``out_dir``).
        FolderBusyError: another process is writing ``out_dir``.
        DiskFullError: the disk filled up.
    """
    out_dir = Path(out_dir)
    rules = dict(
        inputs=list(inputs), overwrite=overwrite, flag=flag, known_outputs=tuple(known_outputs)
    )
    check_output_folder(out_dir, **rules)
    with sigterm_as_interrupt():
        return _write_folder(out_dir, fill, rules)


def _write_folder(out_dir: Path, fill: Callable[[Path], Any], rules: dict[str, Any]) -> Any:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    created = not out_dir.exists()
    out_dir.mkdir(exist_ok=True)
    try:
        with folder_lock(out_dir, what="output folder"):
            check_output_folder(out_dir, **rules)
            return _swap_in(out_dir, fill)
    except BaseException as e:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only if still empty
        if is_disk_full(e, out_dir.parent) and not isinstance(e, DiskFullError):
            raise disk_full_error(out_dir, e) from e
        raise


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Remove the ``.NAME.XXXXXXXX.tmp`` siblings of ``out_dir`` that killed writes left
    (call with ``out_dir`` locked: a live writer of it would hold the lock)."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.[A-Za-z0-9_]{{8}}\.tmp")
    for p in out_dir.parent.iterdir():
        if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _swap_in(out_dir: Path, fill: Callable[[Path], Any]) -> Any:
    _remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~_current_umask())
    old = None
    try:
        result = fill(tmp)
        _normalise_modes(tmp)
        write_marker(tmp)
        _fsync_tree(tmp)
        if any(out_dir.iterdir()):
            old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)  # rename(2) replaces an empty folder
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result
