"""Exclusive locks on folders, so that only one moelab process writes into a run or output
folder at a time.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the folder itself (an ``O_RDONLY`` descriptor of
the directory): no lock file is created, the kernel drops the lock when the process dies
(even by SIGKILL), so a crashed run never leaves a stale lock behind. Our choice: ``fcntl``
rather than a lock-file library, because a lock file would make a fresh run folder non-empty
and would outlive a killed process on some filesystems. Not available on Windows, where the
lock is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moelab.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class FolderBusyError(UserError):
    """Another process holds the folder's lock (it is writing into the folder)."""


@contextmanager
def folder_lock(folder: str | os.PathLike[str], *, what: str = "folder") -> Iterator[Path]:
    """Hold an exclusive lock on the existing folder ``folder`` for the ``with`` block.

    Re-locking a folder this process already holds (through another descriptor) also fails,
    so nested commands cannot write into one folder twice.

    Args:
        folder: an existing folder.
        what: how the error message calls it (``"run folder"``, ``"output folder"``).
    Yields:
        ``Path(folder)``.
    Raises:
        FolderBusyError: another process (or descriptor) holds the lock.
        NotADirectoryError / FileNotFoundError: ``folder`` is not an existing folder.
    """
    folder = Path(folder)
    if fcntl is None:  # pragma: no cover
        yield folder
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusyError(
                f"{folder}: another moelab process is writing to this {what}; "
                "wait for it to finish or stop it, then retry"
            ) from None
        yield folder
    finally:
        os.close(fd)  # closing the descriptor releases the lock
