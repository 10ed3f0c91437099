"""The HTTP server against the real ``openai`` client and raw HTTP, on a live 127.0.0.1 server."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx
import openai
import pytest

from moelab.data import ByteTokenizer
from moelab.serve.generate import generate_ids

from .live import live_server, tiny_byte_model, wait_until

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    model = tiny_byte_model()
    with live_server(model, max_batch=4, max_queue=16) as (url, engine):
        yield url, engine, model


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def greedy(model, prompt: str, n: int) -> str:
    return TOK.decode(
        list(generate_ids(model, TOK.encode(prompt), max_new_tokens=n, temperature=0))
    )


def test_completions_and_chat_streamed_and_not(server):
    url, _, model = server
    c = client(url)
    r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0)
    assert r.choices[0].text == greedy(model, "ROMEO:", 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 12, 18)
    pieces = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == r.choices[0].text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    prompt = "system: Be brief.\nuser: Hi\nassistant:"  # the plain template
    full = greedy(model, prompt, 10)
    want = full.split("\nuser:")[0]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens == len(TOK.encode(prompt))
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_concurrent_requests_equal_single_sequence_results(server):
    url, _, model = server
    c = client(url)
    prompts = ["a", "bb", "The ", "xyz", "0123", "q"]
    out: dict[int, str] = {}

    def ask(i: int) -> None:
        r = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=15, temperature=0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(prompts))] == [greedy(model, p, 15) for p in prompts]
    # seeded sampling: the same seed gives the same text; n choices use seed, seed+1, ...
    a = c.completions.create(model="tiny", prompt="x", max_tokens=10, seed=7, n=2)
    b = c.completions.create(model="tiny", prompt="x", max_tokens=10, seed=7)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != a.choices[1].text


def test_routing_extension_field(server):
    url, _, model = server
    r = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, "routing": True})  # fmt: skip
    choice = r.json()["choices"][0]
    rt = choice["routing"]
    assert rt["layers"] == [0, 1] and len(rt["tokens"]) == 4
    k, E = model.cfg.moe.router.top_k, model.cfg.moe.router.num_experts
    for t in rt["tokens"]:
        assert len(t["experts"]) == 2
        assert all(len(ex) == k and len(set(ex)) == k and all(0 <= e < E for e in ex)
                   for ex in t["experts"])  # fmt: skip
    assert TOK.decode([t["id"] for t in rt["tokens"]]) == choice["text"]
    plain = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}).json()  # fmt: skip
    assert "routing" not in plain["choices"][0]


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 422, "model"),
    (json.dumps({"model": "tiny"}).encode(), 422, "prompt"),
    (
        json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "many"}).encode(),
        422,
        "max_tokens",
    ),
    (json.dumps({"model": "tiny", "prompt": 5}).encode(), 422, "prompt"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1000}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (
        json.dumps({"model": "tiny", "prompt": "x", "temperature": -0.5}).encode(),
        400,
        "temperature",
    ),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": []}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": [999]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 100}).encode(), 400, "n"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode(), 413, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, body, status, param):
    url, _, _ = server
    r = httpx.post(url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_input_and_unknown_routes(server):
    url, _, _ = server
    chat = url + "/v1/chat/completions"
    cases = [
        ({"model": "tiny", "messages": []}, 422),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 422),
        ({"model": "tiny", "messages": [{"content": "x"}]}, 422),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 200}]}, 400),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ]
    for body, status in cases:
        r = httpx.post(chat, json=body)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json()
    assert httpx.get(url + "/v1/nothing").status_code == 404
    assert httpx.get(url + "/v1/models/nope").status_code == 404
    assert httpx.get(url + "/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(url).completions.create(model="tiny", prompt="x", temperature=-1)


def test_health_and_metrics(server):
    url, engine, _ = server
    httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3})
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["running"] == 0
    text = httpx.get(url + "/metrics").text
    for name in ("moelab_requests_total", "moelab_time_to_first_token_seconds_bucket",
                 "moelab_time_per_output_token_seconds_count", "moelab_queue_depth",
                 "moelab_generation_tokens_total", 'moelab_expert_tokens_total{expert="0",layer="1"}'):  # fmt: skip
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("moelab_generation_tokens_total")]
    assert float(gen[0].split()[-1]) == engine.stats.generated_tokens > 0
    assert 'endpoint="/v1/completions",status="200"' in text


def test_api_key():
    with live_server(api_key="sekrit") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 401
        r = client(url, key="sekrit").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.get(url + "/").status_code == 200  # the page itself holds no data


def test_full_queue_gets_429_and_disconnects_free_slots():
    with live_server(step_delay=0.02, max_batch=1, max_queue=1) as (url, engine):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True}
        with httpx.Client(timeout=10) as h1, httpx.Client(timeout=10) as h2:
            with h1.stream("POST", url + "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                next(lines)
                assert wait_until(lambda: engine.num_running == 1)
                waiting = threading.Thread(
                    target=lambda: h2.post(url + "/v1/completions", json={**body, "stream": False}),
                    daemon=True,
                )
                waiting.start()
                assert wait_until(lambda: engine.num_waiting == 1)
                r = httpx.post(url + "/v1/completions", json=body)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            # the streamed client closed its connection: its sequence is cancelled and the
            # waiting request takes the slot
            waiting.join(timeout=30)
            assert not waiting.is_alive()
        assert engine.stats.finished.get("cancelled", 0) >= 1
        # a non-streamed client that times out frees its slot too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
        assert wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
        assert engine.stats.finished["cancelled"] >= 2
        assert engine.cache.lengths == [0]
        ok = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert ok.json()["usage"]["completion_tokens"] == 3


def test_request_timeout_is_504():
    with live_server(step_delay=0.02, request_timeout_s=0.2) as (url, engine):
        r = httpx.post(url + "/v1/completions",
                       json={"model": "tiny", "prompt": "x", "max_tokens": 100})  # fmt: skip
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert wait_until(lambda: engine.num_running == 0)
