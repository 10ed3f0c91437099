"""``moelab train`` on two real rank processes (launched as torchrun launches them: the same
command with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), expert parallel unless
said otherwise, when one rank freezes or works alone for long.

- a rank stopped (SIGSTOP) mid-training: its peer stops with one clear line within the
  process-group timeout (``--dist-timeout``), not torch's 30 minutes;
- SIGTERM to a rank blocked in a collective (its peer stopped): it exits within the stop
  grace (``--stop-grace``) with code 143 and one line saying why;
- SIGTERM to both ranks of a healthy run still stops them cleanly with a checkpoint;
- under data parallelism, a validation on rank 0 alone longer than the timeout is no timeout
  (the other rank waits on rank 0's heartbeat, not in one collective).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from moelab.parallel.launch import free_port

from .conftest import ENV, inject_cmd

pytestmark = pytest.mark.slow

TRAIN = [
    "train", "--d-model", "32", "--layers", "1", "--heads", "2",
    "--experts", "4", "--top-k", "2", "--expert-ffn", "32", "--steps", "200",
    "--batch-size", "2", "--seq-len", "16", "--eval-every", "1000", "--eval-tokens", "64",
    "--checkpoint-every", "0", "--log-every", "1", "--no-progress",
]  # fmt: skip
STOP_RANK_AT_STEP_3 = ("stop", "moelab.train.loop:sample_batch", 4, "before")


class Ranks:
    """Two rank processes of one ``moelab train`` run; each one's output goes to a log file."""

    def __init__(
        self, tmp_path: Path, corpus: Path, *extra: str, faults: dict | None = None, ep: bool = True
    ):
        port, self.logs, self.procs = free_port(), [], []
        self.out = tmp_path / "run"
        for rank in range(2):
            env = {
                **ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            }  # fmt: skip
            cmd = inject_cmd(
                *TRAIN, *(["--expert-parallel", "2"] if ep else []), "--data", str(corpus),
                "--out", str(self.out), *extra, fault=(faults or {}).get(rank),
            )  # fmt: skip
            log = (tmp_path / f"rank{rank}.log").open("w")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            )

    def output(self, rank: int) -> str:
        self.logs[rank].flush()
        return Path(self.logs[rank].name).read_text()

    def wait_stopped(self, rank: int, timeout: float = 120.0) -> None:
        """Until ``rank`` is in state T (stopped) per /proc."""
        proc, end = self.procs[rank], time.monotonic() + timeout
        while time.monotonic() < end:
            assert proc.poll() is None, self.output(rank)
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} never reached its stop point: {self.output(rank)}")

    def exit_time(self, rank: int, timeout: float) -> float:
        """Seconds until ``rank`` exits (fails the test after ``timeout``)."""
        t0 = time.monotonic()
        try:
            self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"rank {rank} still running after {timeout} s: {self.output(rank)}"
            ) from None
        return time.monotonic() - t0

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
                proc.wait()
        for log in self.logs:
            log.close()


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_stopped_rank_ends_its_peer_within_the_timeout(corpus, tmp_path):
    ranks = Ranks(tmp_path, corpus, "--dist-timeout", "10", faults={0: STOP_RANK_AT_STEP_3})
    try:
        ranks.wait_stopped(0)
        waited = ranks.exit_time(1, timeout=40)
        text = ranks.output(1)
        assert ranks.procs[1].returncode == 2, text
        # rank 1 was blocked in a collective with rank 0: the 10 s limit ended it (it may have
        # entered the collective a little before rank 0 was seen stopped)
        assert 5 < waited < 10 + 20, (waited, text)
        assert "Traceback" not in text, text
        errors = [line for line in _lines(text) if line.startswith("error:")]
        assert errors == [
            "error: rank 1: another rank did not answer for 10 s (it is stopped, hung or gone); "
            "stopped here, the last checkpoint stays valid (--dist-timeout sets the limit)"
        ], text
    finally:
        ranks.close()


def test_sigterm_ends_a_rank_blocked_in_a_collective_after_the_grace(corpus, tmp_path):
    extra = ("--dist-timeout", "300", "--stop-grace", "3")
    ranks = Ranks(tmp_path, corpus, *extra, faults={1: STOP_RANK_AT_STEP_3})
    try:
        ranks.wait_stopped(1)
        time.sleep(1.0)  # rank 0 reaches the collective its stopped peer never joins
        ranks.procs[0].send_signal(signal.SIGTERM)
        waited = ranks.exit_time(0, timeout=60)
        text = ranks.output(0)
        assert ranks.procs[0].returncode == 128 + signal.SIGTERM, text
        assert 3 <= waited < 3 + 12, (waited, text)
        assert (
            "moelab: rank 0: still blocked 3 s after SIGTERM (in a collective: is another "
            "rank stopped or gone?); exiting without a new checkpoint, the last one stays valid"
        ) in _lines(text), text
        assert "Traceback" not in text, text
    finally:
        ranks.close()


def test_sigterm_to_a_healthy_run_still_checkpoints(corpus, tmp_path):
    # a run far longer than the test: on a fast machine 200 steps end before the signal lands
    ranks = Ranks(tmp_path, corpus, "--dist-timeout", "60", "--steps", "1000000")
    try:
        metrics, end = ranks.out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
            assert time.monotonic() < end and ranks.procs[0].poll() is None, ranks.output(0)
            time.sleep(0.05)
        for proc in ranks.procs:
            proc.send_signal(signal.SIGTERM)
        for rank in range(2):
            ranks.exit_time(rank, timeout=60)
            assert ranks.procs[rank].returncode == 130, ranks.output(rank)
        latest = json.loads((ranks.out / "checkpoints" / "latest.json").read_text())
        assert latest["step"] >= 3
        assert f"interrupted at step {latest['step']}; checkpoint saved" in ranks.output(0)
    finally:
        ranks.close()


def test_a_validation_on_rank_0_longer_than_the_timeout_is_no_timeout(corpus, tmp_path):
    slow_validation = ("sleep:8", "moelab.train.loop:evaluate", 2, "before")  # the one at step 3
    extra = ("--dist-timeout", "3", "--steps", "4", "--eval-every", "3")
    ranks = Ranks(tmp_path, corpus, *extra, faults={0: slow_validation}, ep=False)
    try:
        for rank in range(2):
            ranks.exit_time(rank, timeout=120)
            assert ranks.procs[rank].returncode == 0, ranks.output(rank)
        evals = [
            json.loads(line)["step"]
            for line in (ranks.out / "metrics.jsonl").read_text().splitlines()
            if '"val"' in line
        ]
        assert evals == [0, 3, 4]
        assert (ranks.out / "manifest.json").is_file()
    finally:
        ranks.close()
