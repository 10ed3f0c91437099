from pathlib import Path

import pytest

from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.data.fortunes import load_fortunes, parse_fortunes
from moelab.errors import MissingDependencyError

PEOPLE = (
    "A bore is a man who talks so much about himself.\n"
    "\t\t-- Anon   \n"
    "%\n"
    "This is the ___\b\b\bLAST time, *_\bI* say.\n"
    "%\n"
    "%\n"  # an empty entry: dropped
    "Last entry, no closing percent line.\n"
)


def _fortunes(root: Path) -> Path:
    root.mkdir()
    (root / "people").write_text(PEOPLE)
    (root / "people.dat").write_bytes(b"\x00\x00\x00\x02\xff\xfe")  # strfile index: skipped
    (root / "people.u8").symlink_to("people")  # link: skipped
    (root / "cookie").write_text("You will be lucky.\n%\nSoon.\n%\n")
    (root / "tiny").write_text("Only one.\n%\n")
    (root / "ethnic").write_text("x\n%\ny\n%\n")  # excluded by default
    (root / "off").mkdir()  # fortunes-off's offensive set: never read
    (root / "off" / "people").write_text("offensive\n%\nmore\n%\n")
    return root


def test_parse_resolves_overstrikes_and_drops_empty_entries():
    assert parse_fortunes(PEOPLE) == [
        "A bore is a man who talks so much about himself.\n\t\t-- Anon",
        "This is the LAST time, *I* say.",
        "Last entry, no closing percent line.",
    ]
    assert parse_fortunes("B\bB\bBold\n") == ["Bold"]  # bold: the same char struck twice


def test_categories(tmp_path):
    root = _fortunes(tmp_path / "f")
    data = load_fortunes(root, min_entries=2)
    assert data.label_names == ("cookie", "people")  # tiny (1 entry) dropped, ethnic excluded
    assert data.class_counts() == [2, 3]
    assert data.texts[:2] == ("You will be lucky.", "Soon.")
    assert "offensive" not in data.texts
    everything = load_fortunes(root, min_entries=1, exclude=())
    assert everything.label_names == ("cookie", "ethnic", "people", "tiny")
    assert len(everything) == 2 + 2 + 3 + 1
    with pytest.raises(CorpusError, match="no class has 4 examples"):
        load_fortunes(root, min_entries=4)


def test_missing_fortunes_say_how_to_install(tmp_path):
    for root in (tmp_path / "nowhere", tmp_path):  # missing folder, folder without categories
        with pytest.raises(MissingDependencyError) as info:
            load_fortunes(root)
        assert isinstance(info.value, CorpusNotInstalledError)
        assert str(info.value).endswith("install them with: apt-get install fortunes fortunes-min")


def test_non_utf8_file_is_named(tmp_path):
    root = tmp_path / "f"
    root.mkdir()
    (root / "latin").write_bytes(b"caf\xe9\n%\n")
    with pytest.raises(CorpusError, match=r"latin: not UTF-8"):
        load_fortunes(root, min_entries=1)


REAL = Path("/usr/share/games/fortunes")


@pytest.mark.skipif(
    not (REAL / "people").is_file(),
    reason="fortunes not installed (apt-get install fortunes fortunes-min)",
)
def test_real_fortunes_counts():
    data = load_fortunes()
    counts = dict(zip(data.label_names, data.class_counts(), strict=True))
    assert len(counts) == 30 and len(data) == 13_948
    assert counts["people"] == 1_251 and min(counts.values()) == counts["linuxcookie"] == 103
    assert "ethnic" not in counts and "men-women" not in counts
    assert not any("\b" in t for t in data.texts)
