"""``moelab serve`` as a real process under faults: an exception inside the engine (injected
at a prefill, a decode step, or one request's sampling) ends only the requests it concerns,
with an error, and the server stays healthy; hostile bodies get 400s and clean log lines;
an empty API key and a busy port are refused before anything is announced.

Every server binds 127.0.0.1, every wait and request loop is bounded, and every process is
stopped (SIGTERM, then SIGKILL) when its test ends.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time

import httpx2 as httpx
import pytest
import torch

from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model

from .conftest import ENV, inject_cmd, moelab_proc, one_line_error

pytestmark = pytest.mark.slow

TIMEOUT = 30.0
"""Seconds any single request may take (the old failures hung forever)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=256)).eval(), folder)
    ByteTokenizer().save(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(run, tmp_path, *args, fault=None):
    """Yield ``(base_url, log)`` of ``moelab serve RUN`` (with ``fault`` injected);
    ``log()`` returns what the process printed so far."""
    port = _free_port()
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            inject_cmd("serve", str(run), "--host", "127.0.0.1", "--port", str(port), *args,
                       fault=fault),
            env=ENV, stdout=log_file, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "server did not start\n" + log_path.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, log_path.read_text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _complete(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)


def _healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    ok = _complete(url)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text


# ------------------------------------------------------------ faults inside the engine
@pytest.mark.parametrize("call, where", [(1, "prefill"), (3, "decode")])
def test_engine_fault_fails_the_affected_request_and_the_server_stays_healthy(
    run, tmp_path, call, where
):
    # KV-cache writes, 2 layers: calls 1-2 are the first prefill, 3-4 its first decode step
    fault = ("raise", "moelab.serve.kv_slots:SlotKVCache.update", call, "before")
    with serving(run, tmp_path, fault=fault) as (url, log):
        if where == "prefill":  # the request used to leave the queues and hang forever
            r = _complete(url)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["message"] == "engine: RuntimeError: injected fault"
        else:  # streamed: the error arrives as an event after the first token
            body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "temperature": 0,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            events = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
            assert "choices" in events[0]  # the first token, sampled at the prefill
            assert events[-1]["error"]["message"] == "engine: RuntimeError: injected fault"
        _healthy(url)
        assert "injected fault" in log() and "Traceback" in log()  # the operator sees the bug


def test_one_requests_sampling_failure_spares_the_requests_beside_it(run, tmp_path):
    fault = ("raise", "moelab.serve.engine:sample_next", 2, "before")
    with serving(run, tmp_path, "--max-batch", "4", fault=fault) as (url, _):
        # settings that are fine as doubles but 0 or inf in float32 never reach the engine
        for field, value in (("top_p", 1e-300), ("temperature", 1e300)):
            r = _complete(url, **{field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = _complete(url, seed=2**64)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        results: list[httpx.Response | None] = [None] * 4

        def client(i: int) -> None:
            results[i] = _complete(url, temperature=0.9, seed=i, max_tokens=6)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT + 5)
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 200, 200, 500], [r.text for r in results]
        failed = next(r for r in results if r.status_code == 500)
        assert failed.json()["error"]["message"] == "sampling: RuntimeError: injected fault"
        for r in results:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 6
        _healthy(url)


# ------------------------------------------------------------ hostile bodies
def test_hostile_bodies_get_400_and_leave_clean_logs(run, tmp_path):
    with serving(run, tmp_path) as (url, log):
        deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        shallow_but_long = b'{"model": "tiny", "prompt": "x", "x": ' + b"[" * 40 + b"]" * 40 + b"}"
        cases = [
            (deep, None, "nested deeper"),
            (shallow_but_long, None, "nested deeper"),
            (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt", "lone surrogate"),
            (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
             "messages", "lone surrogate"),
        ]  # fmt: skip
        for body, param, words in cases:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            r = httpx.post(url + path, content=body, timeout=TIMEOUT,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            assert r.status_code == 400, (body[:60], r.text)
            assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == param
        # a body cut short: the client promises 1000 bytes, sends 20 and hangs up
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"model": "tiny", ')  # fmt: skip
            time.sleep(0.3)
        _healthy(url)
        time.sleep(0.3)
        text = log()
        assert "Traceback" not in text and "ClientDisconnect" not in text, text


# ------------------------------------------------------------ refused before serving
@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_refused(run, how):
    port = str(_free_port())
    if how == "flag":
        proc = moelab_proc("serve", str(run), "--port", port, "--api-key", "", timeout=60)
    else:
        proc = subprocess.run(
            inject_cmd("serve", str(run), "--port", port),
            env={**ENV, "MOELAB_API_KEY": ""}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert "api_key: empty" in one_line_error(proc)
    assert "moelab serve" not in proc.stdout


def test_a_busy_port_is_reported_before_the_banner(run):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = moelab_proc("serve", str(run), "--port", str(port), timeout=60)
    line = one_line_error(proc)
    assert f"port: cannot listen on 127.0.0.1:{port}" in line and "in use" in line
    assert "moelab serve" not in proc.stdout
