"""Path confinement: names read from inside a folder (manifest entries, ``latest.json``'s
``dir``, shard-index entries, tokenizer files) must stay inside that folder.

A name is resolved against its folder with every symlink followed; it is accepted only when
the result lies inside the (resolved) folder. Absolute names, ``..`` escapes, NUL bytes and
symlinks that leave the folder are refused with :class:`UnsafePathError` naming the folder,
the entry and where it leads.
"""

from __future__ import annotations

import os
from pathlib import Path

from moelab.errors import InvalidValueError


class UnsafePathError(InvalidValueError):
    """A file named from inside a folder lies outside it (or a write would follow a symlink)."""


def is_within(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """True when ``path`` is ``folder`` or lies inside it, both resolved (symlinks followed)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def confined(
    folder: str | os.PathLike[str],
    name: object,
    *,
    what: str = "file",
    within: str | os.PathLike[str] | None = None,
) -> Path:
    """``folder / name`` after checking that it stays inside ``folder`` (or ``within``).

    Args:
        folder: the folder the name was read from (or belongs to).
        name: a relative name such as ``"model.safetensors"`` or ``"step-000200"``.
        what: how the error message calls the entry (``"manifest entry"``, ...).
        within: a folder around ``folder`` the name may lead into instead (a Hugging Face
            hub snapshot's files are links into its repository's ``blobs/``).
    Returns:
        ``Path(folder) / name`` (not resolved, so messages keep the user's spelling).
    Raises:
        UnsafePathError: ``name`` is not a non-empty string, is absolute, contains a NUL byte,
            or resolves (through ``..`` or symlinks) outside ``folder``.
    """
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafePathError(f"{folder}: {what} {name!r} is not a valid file name")
    if os.path.isabs(name):
        raise UnsafePathError(
            f"{folder}: {what} {name!r} is an absolute path; only names inside the folder are read"
        )
    target = folder / name
    if not is_within(target, folder if within is None else within):
        raise UnsafePathError(
            f"{folder}: {what} {name!r} leads outside the folder (to {target.resolve()})"
        )
    return target


def refuse_symlink(path: str | os.PathLike[str], *, what: str = "file") -> Path:
    """``path`` after checking it is not a symbolic link (moelab never writes through one).

    Raises:
        UnsafePathError: ``path`` is a symlink.
    """
    path = Path(path)
    if path.is_symlink():
        raise UnsafePathError(
            f"{path}: the {what} is a symbolic link (to {os.readlink(path)}); "
            "moelab does not write through links, remove it or choose another path"
        )
    return path
