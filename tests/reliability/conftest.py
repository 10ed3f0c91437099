"""Shared pieces of the reliability suite: a tiny corpus, the tiny training command, a
helper that runs ``moelab`` as a real process (optionally with a fault injected by
``inject.py``), an uninterrupted reference run, and a bit-for-bit run comparison."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import moelab

HERE = Path(__file__).parent
SRC = str(Path(moelab.__file__).resolve().parents[1])
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
    "COLUMNS": "200",
}
STEPS = 8
TRAIN = [
    "train", "--d-model", "32", "--layers", "2", "--heads", "4", "--experts", "4",
    "--top-k", "2", "--expert-ffn", "32", "--steps", str(STEPS), "--batch-size", "4",
    "--seq-len", "32", "--grad-accum", "2", "--eval-every", "4", "--eval-tokens", "128",
    "--checkpoint-every", "2", "--log-every", "1", "--warmup-steps", "2", "--no-progress",
]  # fmt: skip
TIMING_KEYS = {"tokens_per_s"}
SEED = int(os.environ.get("MOELAB_RELIABILITY_SEED", "0"))
"""Seeds the random kill points; a failure message prints it (rerun with the same seed)."""


def rng(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


def inject_cmd(*args: str, fault: tuple[str, str, int, str] | None = None) -> list[str]:
    action, target, n, when = fault or ("none", "-", 0, "before")
    return [sys.executable, str(HERE / "inject.py"), action, target, str(n), when, "--", *args]


def moelab_proc(*args: str, fault=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``moelab ARGS`` as a child process (with ``fault`` injected); capture output."""
    return subprocess.run(
        inject_cmd(*args, fault=fault), env=ENV, capture_output=True, text=True, timeout=timeout
    )


def start_proc(*args: str, fault=None) -> subprocess.Popen:
    return subprocess.Popen(
        inject_cmd(*args, fault=fault),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a failed command (asserts exit 2 and no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def train_args(corpus: Path, out: Path) -> list[str]:
    return [*TRAIN, "--data", str(corpus), "--out", str(out)]


def resume_args(out: Path) -> list[str]:
    return ["train", "--out", str(out), "--resume", "--no-progress"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    r = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "from"]
    text = "\n\n".join(" ".join(r.choice(words) for _ in range(120)) for _ in range(40))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory) -> Path:
    """The uninterrupted run every faulted run must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("ref") / "run"
    proc = moelab_proc(*train_args(corpus, out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def finished_run(reference, tmp_path) -> Path:
    """A private copy of the finished reference run."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    return out


def metrics(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs]


def assert_same_run(run: Path, reference: Path) -> None:
    """Final weights bit-identical, metrics identical (timings aside), run finished."""
    assert (run / "manifest.json").is_file(), sorted(p.name for p in run.iterdir())
    a, b = (
        load_file(str(run / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (seed {SEED})"
    assert metrics(run) == metrics(reference), f"metrics differ (seed {SEED})"


def leftovers(folder: Path) -> list[str]:
    """Temp files/folders a write left behind."""
    return sorted(str(p) for p in folder.rglob("*") if p.name.endswith(".tmp"))
