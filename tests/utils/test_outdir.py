import json

import pytest

from moelab.utils.atomic import write_folder_atomically
from moelab.utils.outdir import (
    MARKER,
    OutputExistsError,
    OutputFolderError,
    check_output_folder,
)


def fill_with(names):
    def fill(tmp):
        for n in names:
            (tmp / n).write_text(n)
        return sorted(names)

    return fill


def test_new_folder_written_with_a_marker(tmp_path):
    out = tmp_path / "o"
    assert write_folder_atomically(out, fill_with(["a", "b"])) == ["a", "b"]
    listed = json.loads((out / MARKER).read_text())["files"]
    assert listed == sorted(["a", "b", MARKER])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temp folder left


@pytest.mark.parametrize(
    ("rel", "word"), [(".", "is"), ("..", "contains"), ("src/x", "lies inside")]
)
def test_output_overlapping_an_input_is_refused(tmp_path, rel, word):
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep").write_text("k")
    out = (src / rel) if rel != ".." else tmp_path
    if rel == "src/x":
        out = src / "x"
    with pytest.raises(OutputFolderError, match=f"output {word} the input"):
        write_folder_atomically(out, fill_with(["a"]), overwrite=True, inputs=[src])
    assert (src / "keep").read_text() == "k"


def test_overwrite_rules(tmp_path):
    out = tmp_path / "o"
    write_folder_atomically(out, fill_with(["a"]))
    with pytest.raises(OutputExistsError, match="--overwrite"):
        write_folder_atomically(out, fill_with(["b"]))
    assert isinstance(OutputExistsError("x"), FileExistsError)
    write_folder_atomically(out, fill_with(["b"]), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b"]
    (out / "user.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match=r"user\.txt"):
        write_folder_atomically(out, fill_with(["c"]), overwrite=True)
    assert (out / "user.txt").read_text() == "mine" and (out / "b").is_file()


def test_marker_less_folders(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.html").write_text("old")
    with pytest.raises(OutputFolderError, match="not written by moelab"):
        check_output_folder(out, overwrite=True)
    check_output_folder(out, overwrite=True, known_outputs=["report.html", "plots"])


def test_symlink_and_file_outputs_are_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputFolderError, match="symbolic link"):
        check_output_folder(tmp_path / "link")
    with pytest.raises(OutputFolderError, match="not a folder"):
        check_output_folder(tmp_path / "file")


def test_failed_fill_leaves_the_old_folder(tmp_path):
    out = tmp_path / "o"
    write_folder_atomically(out, fill_with(["a"]))

    def boom(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_folder_atomically(out, boom, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    with pytest.raises(RuntimeError):
        write_folder_atomically(tmp_path / "new", boom)
    assert not (tmp_path / "new").exists()
