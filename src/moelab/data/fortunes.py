"""Fortune-cookie quotations labelled by category, from Debian's ``fortunes`` and
``fortunes-min`` (``/usr/share/games/fortunes/<category>``; the program is BSD, the content a
mix of quotations).

A category is a regular file directly in the folder whose name has no dot (so the strfile
indexes ``*.dat`` and the ``*.u8`` links are skipped) and is not excluded. Sub-folders are
never read: the offensive set of ``fortunes-off`` lives in ``off/``. Excluded by default:
``ethnic`` and ``men-women`` (stereotypes; the data survey's advice). Entries are separated by
lines holding only ``%``; backspace overstrikes (old terminal bold and underline, ``_\bX`` or
``___\b\b\bend``) are resolved as a terminal prints them, a character winning over an
underscore; entries that are empty after stripping are dropped.

Real data (``fortunes`` + ``fortunes-min`` 1:1.99.1-7.3): 43 categories, ``people`` (1,250)
to ``pratchett`` (1); with the default exclusions and ``min_entries=100``, 30 categories and
13,948 entries.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.data.labelled import LabelledText

FORTUNES_INSTALL = "apt-get install fortunes fortunes-min"
DEFAULT_FORTUNES_ROOT = Path("/usr/share/games/fortunes")
EXCLUDED_FORTUNES = ("ethnic", "men-women")
"""Categories left out by default (ethnic and gender stereotypes)."""


def _overstrike(line: str) -> str:
    """``line`` as a terminal shows it: a backspace moves back one column, the next
    character overwrites that column (an underscore never hides another character)."""
    if "\b" not in line:
        return line
    out: list[str] = []
    col = 0
    for ch in line:
        if ch == "\b":
            col = max(col - 1, 0)
            continue
        if col < len(out):
            if ch != "_" or out[col] == "_":
                out[col] = ch
        else:
            out.append(ch)
        col += 1
    return "".join(out)


def parse_fortunes(text: str) -> list[str]:
    """The entries of one fortune file: ``%``-line separated, overstrikes resolved, each entry
    stripped, empty ones dropped."""
    entries, current = [], []
    for line in map(_overstrike, text.splitlines()):
        if line.rstrip() == "%":
            entries.append("\n".join(current).strip())
            current = []
        else:
            current.append(line.rstrip())
    entries.append("\n".join(current).strip())
    return [e for e in entries if e]


def load_fortunes(
    root: str | Path | None = None,
    *,
    min_entries: int = 100,
    exclude: Iterable[str] = EXCLUDED_FORTUNES,
) -> LabelledText:
    """Fortune entries labelled by their file's category, classes in sorted order.

    Args:
        root: the fortunes folder (default ``/usr/share/games/fortunes``).
        min_entries: drop categories with fewer entries.
        exclude: category names never read.

    Raises:
        CorpusNotInstalledError: the folder is missing or holds no category file (says the
            apt-get command).
        CorpusError: a category file is not UTF-8, or no category has ``min_entries``.
        InvalidValueError: bad ``min_entries``.
    """
    folder = DEFAULT_FORTUNES_ROOT if root is None else Path(root)
    excluded = set(exclude)
    files = (
        sorted(
            p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and "." not in p.name
        )
        if folder.is_dir()
        else []
    )
    if not files:
        raise CorpusNotInstalledError(
            f"no fortune files in {folder}; install them with: {FORTUNES_INSTALL}"
        )
    texts, names = [], []
    for path in files:
        if path.name in excluded:
            continue
        try:
            entries = parse_fortunes(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
        texts += entries
        names += [path.name] * len(entries)
    data = LabelledText.from_names(texts, names, "fortunes")
    return data.keep_classes(min_entries)
