import pytest

from moelab.utils.paths import UnsafePathError, confined, is_within, refuse_symlink


def test_confined_accepts_names_inside(tmp_path):
    (tmp_path / "sub").mkdir()
    assert confined(tmp_path, "sub/a.txt") == tmp_path / "sub" / "a.txt"
    assert confined(tmp_path, "sub/../b.txt") == tmp_path / "sub/../b.txt"  # stays inside


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("/etc/passwd", "absolute path"),
        ("../x", "leads outside"),
        ("a/../../x", "leads outside"),
        ("", "not a valid file name"),
        ("a\x00b", "not a valid file name"),
        (3, "not a valid file name"),
    ],
)
def test_confined_refuses_escapes(tmp_path, name, match):
    with pytest.raises(UnsafePathError, match=match):
        confined(tmp_path, name)


def test_symlink_leaving_the_folder_is_refused(tmp_path):
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    (inside / "ok").symlink_to(inside / "target")
    (inside / "bad").symlink_to(outside / "secret")
    assert confined(inside, "ok") == inside / "ok"
    with pytest.raises(UnsafePathError, match="leads outside"):
        confined(inside, "bad")
    assert is_within(inside / "ok", inside) and not is_within(inside / "bad", inside)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        refuse_symlink(inside / "ok")
