"""Kills and stop signals at exact and random points of training and saving, each in a real
``moelab train`` process; the resumed run must equal the uninterrupted one bit for bit.

Call counts of the tiny run (8 steps, grad-accum 2, checkpoint every 2 steps, so checkpoints
at 2, 4, 6 and the final 8, then the model at the run root): ``sample_batch`` is called
``2·step + micro + 1`` times; ``save_file`` (weights) once per checkpoint and once for the
root (calls 1-5); ``models.io._write_json`` twice per model folder (config, then manifest).
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from .conftest import (
    STEPS,
    assert_same_run,
    moelab_proc,
    one_line_error,
    resume_args,
    rng,
    start_proc,
    train_args,
)

pytestmark = pytest.mark.slow
KILLED = -signal.SIGKILL


def _resume_until_done(out, reference) -> None:
    proc = moelab_proc(*resume_args(out))
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, reference)


def test_sigkill_during_training_step(corpus, reference, tmp_path):
    """SIGKILL before a random micro-batch of a random step (not at a checkpoint boundary)."""
    n = rng("train").randrange(3, 2 * STEPS)
    out = tmp_path / "run"
    proc = moelab_proc(
        *train_args(corpus, out), fault=("kill", "moelab.train.loop:sample_batch", n, "before")
    )
    assert proc.returncode == KILLED, proc.stderr
    _resume_until_done(out, reference)


@pytest.mark.parametrize(
    ("target", "when"),
    [
        ("moelab.models.io:save_file", "after"),  # weights written, manifest not yet
        ("moelab.train.checkpoint:atomic_write", "before"),  # trainer state not yet written
        ("moelab.train.checkpoint:atomic_write_json", "before"),  # folder in place, latest.json old
    ],
)
def test_sigkill_while_writing_a_checkpoint(corpus, reference, tmp_path, target, when):
    n = rng(target).randrange(1, 4)  # one of the checkpoints at steps 2, 4, 6
    out = tmp_path / "run"
    proc = moelab_proc(*train_args(corpus, out), fault=("kill", target, n, when))
    assert proc.returncode == KILLED, proc.stderr
    _resume_until_done(out, reference)


@pytest.mark.parametrize(
    ("target", "n", "when"),
    [
        ("moelab.models.io:save_file", 5, "before"),  # final checkpoint done, root not started
        ("moelab.models.io:_write_json", 10, "before"),  # root weights written, no manifest
    ],
)
def test_sigkill_during_the_final_save(corpus, reference, tmp_path, target, n, when):
    """The kill leaves an unfinished run that eval refuses and --resume completes."""
    out = tmp_path / "run"
    proc = moelab_proc(*train_args(corpus, out), fault=("kill", target, n, when))
    assert proc.returncode == KILLED, proc.stderr
    assert not (out / "manifest.json").exists()
    assert "--resume" in one_line_error(moelab_proc("eval", str(out)))
    _resume_until_done(out, reference)
    assert moelab_proc("eval", str(out), "--json").returncode == 0


def test_sigkill_at_random_times(corpus, reference, tmp_path):
    """External SIGKILLs at random wall-clock times, resumed each time until finished."""
    r = rng("wallclock")
    out = tmp_path / "run"
    args = train_args(corpus, out)
    for _ in range(3):
        p = start_proc(*args)
        time.sleep(r.uniform(1.0, 6.0))
        p.kill()
        p.communicate()
        if p.returncode == 0:
            break
        if (out / "run.json").exists():
            args = resume_args(out)
    proc = moelab_proc(*args) if not (out / "manifest.json").exists() else None
    assert proc is None or proc.returncode == 0, proc.stderr
    assert_same_run(out, reference)


@pytest.mark.parametrize("action", ["term", "int"])
def test_stop_signal_mid_accumulation(corpus, reference, tmp_path, action):
    """SIGTERM (like Ctrl-C) in the 2nd micro-batch of a step abandons that step at once,
    checkpoints the last finished step, exits 130; the resume is bit-identical."""
    step = rng(action).randrange(2, STEPS - 1)  # the step being computed (0-based)
    n = 2 * step + 2  # sample_batch call of its second micro-batch
    out = tmp_path / "run"
    proc = moelab_proc(
        *train_args(corpus, out), fault=(action, "moelab.train.loop:sample_batch", n, "before")
    )
    assert proc.returncode == 130, proc.stderr
    assert f"interrupted at step {step}" in proc.stdout
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == step  # the interrupted step was not completed
    _resume_until_done(out, reference)
