"""A full disk during training: a small tmpfs where this machine lets us mount one (root on
Linux), and an injected ``OSError(ENOSPC)`` in any case. Each must end with one error line
naming the file and the space, no temp files left, and a run that resumes (once there is
space) to exactly the uninterrupted result. A torn ``metrics.jsonl`` tail, as a full disk
leaves it, does not block the resume."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest

from .conftest import (
    assert_same_run,
    leftovers,
    moelab_proc,
    one_line_error,
    resume_args,
    train_args,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
    except OSError:
        done = None
    if done is None or done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC case covers it")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _check_failed_cleanly(proc, out):
    line = one_line_error(proc)
    assert "no space left" in line and "bytes free" in line, line
    assert leftovers(out) == []


def test_full_tmpfs_during_training(corpus, reference, tmp_path):
    # 1.5 MB holds the run's first two checkpoints (0.6 MB each) but not a third
    with small_tmpfs(tmp_path / "mnt", "1500k") as mnt:
        out = mnt / "run"
        proc = moelab_proc(*train_args(corpus, out))
        _check_failed_cleanly(proc, out)
        moved = tmp_path / "run"
        shutil.copytree(out, moved, symlinks=True)  # "free some space": move to a bigger disk
    proc = moelab_proc(*resume_args(moved))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(moved, reference)


@pytest.mark.parametrize(
    ("target", "n"),
    [
        ("moelab.models.io:save_file", 2),  # the weights of the second checkpoint
        ("torch:save", 3),  # the trainer state of the third checkpoint
        ("moelab.models.io:save_file", 5),  # the final model at the run root
    ],
)
def test_injected_enospc(corpus, reference, tmp_path, target, n):
    out = tmp_path / "run"
    proc = moelab_proc(*train_args(corpus, out), fault=("enospc", target, n, "before"))
    _check_failed_cleanly(proc, out)
    assert not (out / "manifest.json").exists()
    proc = moelab_proc(*resume_args(out))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, reference)


def test_torn_metrics_tail_does_not_block_resume(corpus, reference, tmp_path):
    out = tmp_path / "run"
    proc = moelab_proc(
        *train_args(corpus, out), fault=("kill", "moelab.train.loop:sample_batch", 11, "before")
    )
    assert proc.returncode < 0
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "split": "tra')  # what a full disk left behind
    proc = moelab_proc(*resume_args(out))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, reference)


def test_corrupt_metrics_line_is_named(corpus, tmp_path):
    out = tmp_path / "r2"
    moelab_proc(
        *train_args(corpus, out), fault=("kill", "moelab.train.loop:sample_batch", 11, "before")
    )
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = "{not json"
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = one_line_error(moelab_proc(*resume_args(out)))
    assert "metrics.jsonl: line 2" in line
