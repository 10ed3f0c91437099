"""Two writers on one folder, as real processes: the first ``moelab train`` is frozen
(SIGSTOP) in the middle of its run while others try to write into the same run folder or
output folder; they must be refused with one clear line, and the first run must then finish
exactly as if it had been alone."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from .conftest import (
    assert_same_run,
    moelab_proc,
    one_line_error,
    resume_args,
    start_proc,
    train_args,
)

pytestmark = pytest.mark.slow


def _wait_stopped(proc, timeout=120.0) -> None:
    """Wait until ``proc`` is in state T (stopped) per /proc."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.1)
    raise AssertionError("the first writer never reached its stop point")


def test_second_writer_on_a_run_is_refused(corpus, reference, tmp_path):
    out = tmp_path / "run"
    first = start_proc(
        *train_args(corpus, out), fault=("stop", "moelab.train.loop:sample_batch", 7, "before")
    )
    try:
        _wait_stopped(first)
        busy = one_line_error(moelab_proc(*resume_args(out)))
        assert "another moelab process is writing" in busy
        again = one_line_error(moelab_proc(*train_args(corpus, out)))
        assert "not empty" in again or "another moelab process" in again
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert_same_run(out, reference)  # nothing interleaved into its metrics or checkpoints
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)


def test_second_writer_on_an_output_folder_is_refused(finished_run, tmp_path):
    """Two exports into one folder: the second sees the folder locked (or already written)."""
    dst = tmp_path / "hf"
    first = start_proc(
        "convert", str(finished_run), str(dst), "--to", "hf",
        fault=("stop", "moelab.interop.hf:save_file", 1, "before"),
    )  # fmt: skip
    try:
        _wait_stopped(first)
        line = one_line_error(
            moelab_proc("convert", str(finished_run), str(dst), "--to", "hf", "--overwrite")
        )
        assert "another moelab process is writing" in line
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert (dst / "model.safetensors").is_file()
