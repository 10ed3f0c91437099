"""`moelab serve` as a process: start-up output, and a graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from moelab.data import ByteTokenizer
from moelab.models import save_model

from .live import tiny_byte_model, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_then_exits(tmp_path):
    run = tmp_path / "tiny-run"
    save_model(tiny_byte_model(max_seq_len=1024), run)
    ByteTokenizer().save(run)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moelab.cli", "serve", str(run), "--port", str(port),
         "--max-batch", "2", "--grace", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, timeout=60), proc.stdout.read() if proc.poll() is not None else ""
        body = {"model": "tiny-run", "prompt": "x", "max_tokens": 1000, "temperature": 0,
                "stream": True}  # fmt: skip
        texts, finish = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 1:
                    proc.send_signal(signal.SIGTERM)  # mid-generation
                    time.sleep(0.2)
                    with pytest.raises(httpx.TransportError):  # no new connections
                        httpx.get(url + "/health", timeout=2)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
        assert finish == "length"  # the in-flight request ran to its end
        assert len("".join(texts).encode("utf-8", "surrogatepass")) > 0
        # uvicorn re-raises the signal once it has shut down cleanly (exit by SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        out = proc.stdout.read()
        assert f"http://127.0.0.1:{port}/" in out and '"num_experts": 4' in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
