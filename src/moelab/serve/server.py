"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over the batching engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events and ``usage``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus) and ``GET /`` (the
routing page). Every error is an OpenAI error object: malformed JSON 400, wrongly typed or
missing fields 422, out-of-range values (temperature, top_p, empty prompt, max_tokens beyond
the context, ...) 400, unknown model 404, a body over ``max_body_bytes`` 413, a missing or
wrong API key 401, a full queue 429, a server that is shutting down 503, a request past its
timeout 504.

Threads: uvicorn's event loop parses requests and streams responses; the engine runs on its
own thread; each request gets an ``asyncio.Queue`` fed from the engine thread through
``loop.call_soon_threadsafe``. A client that disconnects cancels its sequences, which frees
their cache rows at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from moelab.data import Tokenizer
from moelab.errors import InvalidValueError
from moelab.serve.chat import ChatTemplate
from moelab.serve.engine import (
    Engine,
    EngineClosedError,
    Event,
    QueueFullError,
    Sequence,
    TokenEvent,
)
from moelab.serve.metrics import ServeMetrics
from moelab.serve.page import render_page
from moelab.serve.params import SamplingParams
from moelab.serve.protocol import APIError, ChatRequest, CompletionRequest
from moelab.utils.fields import SEED_MAX

_WATCH_S = 1.0
"""How often a waiting request checks its deadline and the engine thread (seconds)."""

_ENDPOINTS = {
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
}


@dataclass
class ServerConfig:
    """Limits and identity of a server.

    Attributes:
        model_name: the only ``model`` value requests may name (others get 404).
        api_key: when set, every request but ``GET /`` must send ``Authorization: Bearer KEY``
            (:func:`check_api_key`: an empty key is refused, never read as "no key").
        max_body_bytes: larger request bodies get 413.
        request_timeout_s: a request still unfinished after this many seconds is cancelled
            and answered 504 (None = no limit).
        max_n: most choices per request (``n``, times the number of prompts).
        shutdown_grace_s: on shutdown, in-flight requests get this long to finish.
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    request_timeout_s: float | None = 600.0
    max_n: int = 8
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)


def check_api_key(key: str) -> str:
    """``key`` when it can authenticate anyone: non-empty printable ASCII (what an HTTP
    header carries) without surrounding spaces. An empty key (typically an unset
    ``$VARIABLE``) is refused rather than read as "no authentication".

    Raises:
        InvalidValueError: naming the problem (never echoing the key).
    """
    if not key.strip():
        raise InvalidValueError(
            "api_key: empty (an unset environment variable?); give a key, or leave the "
            "option out to serve without authentication"
        )
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise InvalidValueError(
            "api_key: must be printable ASCII without leading or trailing spaces"
        )
    return key


class _Guard:
    """ASGI middleware: API-key check and per-endpoint request counting."""

    def __init__(self, app, config: ServerConfig, metrics: ServeMetrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        status = [500]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            key = self.config.api_key
            if key is not None and not (path == "/" and scope["method"] == "GET"):
                headers = dict(scope["headers"])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not secrets.compare_digest(given.encode(), key.encode()):
                    err = APIError(
                        401,
                        "invalid or missing API key (send Authorization: Bearer KEY)",
                        type="authentication_error",
                        code="invalid_api_key",
                    )
                    await JSONResponse(err.body(), status_code=401)(scope, receive, counting_send)
                    return
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    config: ServerConfig,
    *,
    card: dict[str, Any],
    chat_template: ChatTemplate | None = None,
    offload_stats: Callable[[], dict[str, float]] | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` (started and stopped with the app).

    Args:
        engine: the batching engine over the loaded model (not yet started).
        tokenizer: encodes prompts; its ``eot_id`` ends every sequence.
        config: limits and identity.
        card: :func:`moelab.serve.card.model_card` of the model.
        chat_template: how chat messages become a prompt (default: the plain template).
        offload_stats: the offloaded model's cache statistics for ``/metrics``.
    """
    chat_template = chat_template or ChatTemplate()
    metrics = ServeMetrics(engine, offload_stats)
    page = render_page(card)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.drain, config.shutdown_grace_s)
            engine.stop()

    app = FastAPI(title="moelab serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind
        )
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    # ------------------------------------------------------------ helpers
    async def read_body(request: Request, schema: type[BaseModel]) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise APIError(413, f"body: {length} bytes exceed the limit of {config.max_body_bytes}")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > config.max_body_bytes:
                    raise APIError(413, f"body: exceeds the limit of {config.max_body_bytes} bytes")
        except ClientDisconnect:  # nobody reads the answer; it keeps the log clean
            raise APIError(400, "body: the client disconnected before sending all of it") from None
        try:
            obj = json.loads(body)
        except RecursionError:
            raise APIError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"body: malformed JSON ({e})") from None
        if not isinstance(obj, dict):
            raise APIError(400, "body: must be a JSON object")
        problem = json_problem(obj)
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        try:
            req = schema.model_validate(obj)
        except ValidationError as e:
            errors = e.errors()
            first = errors[0]
            param = str(first["loc"][0]) if first["loc"] else "body"
            loc = ".".join(str(p) for p in first["loc"] if not isinstance(p, str) or p == param)
            union = sum(1 for x in errors if x["loc"][:1] == first["loc"][:1]) > 1
            detail = "wrong type for every accepted form" if union else first["msg"]
            raise APIError(422, f"{loc or param}: {detail}", param=param) from None
        if req.model != config.model_name:
            raise APIError(
                404,
                f"model: {req.model!r} is not served here (serving {config.model_name!r})",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        req.check_values(config.max_n)
        return req

    def prompt_ids(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt: must not be empty", param="prompt")
            if any(not 0 <= t < engine.model.cfg.vocab_size for t in ids):
                raise APIError(
                    400,
                    f"prompt: token ids must be in [0, {engine.model.cfg.vocab_size})",
                    param="prompt",
                )
            out.append(ids)
        return out

    def make_params(req, prompt_len: int, extra_stop_ids=(), extra_stop=()) -> SamplingParams:
        context = engine.max_seq_len
        if prompt_len >= context:
            raise APIError(
                400,
                f"prompt: {prompt_len} tokens leave no room in the context length of {context}",
                param="prompt" if isinstance(req, CompletionRequest) else "messages",
                code="context_length_exceeded",
            )
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(req, CompletionRequest) else context - prompt_len
        if prompt_len + max_tokens > context:
            raise APIError(
                400,
                f"max_tokens: the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) "
                f"exceed the context length of {context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = tuple(extra_stop_ids)
        if tokenizer.eot_id is not None:
            stop_ids += (tokenizer.eot_id,)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=req.seed,
                stop_ids=stop_ids,
                stop=tuple(req.stop_list()) + tuple(extra_stop),
                routing=req.routing,
                timeout_s=config.request_timeout_s,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None

    def submit_all(jobs: list[tuple[list[int], SamplingParams]]):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        seqs: list[Sequence] = []

        def sink_for(i: int):
            def sink(ev: Event) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
                    loop.call_soon_threadsafe(queue.put_nowait, (i, ev))

            return sink

        try:
            for i, (ids, params) in enumerate(jobs):
                seqs.append(engine.submit(ids, params, sink_for(i)))
        except QueueFullError as e:
            for s in seqs:
                s.cancel()
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except EngineClosedError as e:
            for s in seqs:
                s.cancel()
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except ValueError as e:
            for s in seqs:
                s.cancel()
            raise APIError(400, str(e)) from None
        return queue, seqs

    async def watch_disconnect(request: Request, seqs: list[Sequence]) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for s in seqs:
                    s.cancel()
                return

    def routing_token(ev: TokenEvent) -> dict[str, Any]:
        return {"id": ev.token_id, "text": ev.token_text, "experts": ev.experts}

    def usage(seqs: list[Sequence], prompt_lens: list[int]) -> dict[str, int]:
        p = sum(prompt_lens)
        c = sum(len(s.output_ids) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def engine_error(seqs: list[Sequence]) -> APIError:
        why = next((s.error for s in seqs if s.finish_reason == "error" and s.error), None)
        return APIError(500, why or "engine: generation failed", type="server_error")

    async def next_event(
        queue: asyncio.Queue[tuple[int, Event]], seqs: list[Sequence], deadline: float | None
    ) -> tuple[int, Event]:
        """The next engine event. Past ``deadline`` (the request timeout plus a second) it
        answers 504 and while the engine thread is gone 503, by itself: a request the
        engine never finishes must still end, whatever went wrong in the engine."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), _WATCH_S)
            except TimeoutError:
                if not engine.alive:
                    for s in seqs:
                        s.cancel()
                    raise APIError(
                        503, "engine: its thread stopped; restart the server",
                        type="server_error", code="engine_stopped",
                    ) from None  # fmt: skip
                if deadline is not None and time.monotonic() > deadline:
                    for s in seqs:
                        s.cancel()
                    raise timeout_error() from None

    def timeout_error() -> APIError:
        return APIError(
            504,
            f"request: not finished within {config.request_timeout_s} s",
            type="timeout_error",
            code="timeout",
        )

    async def run(request: Request, req, chat: bool):
        if chat:
            try:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                text = chat_template.render(messages)
            except ValueError as e:
                raise APIError(400, f"messages: {e}", param="messages") from None
            prompts = prompt_ids(text)
            extra_stop = chat_template.default_stop
            eos = chat_template.eos_token
            eos_ids = tokenizer.encode(eos) if eos else []
            extra_ids = tuple(eos_ids) if len(eos_ids) == 1 else ()
        else:
            prompts = prompt_ids(req.prompt)
            extra_stop, extra_ids = [], ()
        if len(prompts) * req.n > config.max_n:
            raise APIError(
                400,
                f"n: {len(prompts)} prompts x n={req.n} exceed {config.max_n} choices",
                param="n",
            )
        jobs, prompt_lens = [], []
        for ids in prompts:
            prompt_lens.append(len(ids))
            base = make_params(req, len(ids), extra_ids, extra_stop)
            for j in range(req.n):
                seed = None if base.seed is None else (base.seed + j) % (SEED_MAX + 1)
                jobs.append((ids, _with_seed(base, seed)))
        queue, seqs = submit_all(jobs)
        deadline = None
        if config.request_timeout_s is not None:
            deadline = time.monotonic() + config.request_timeout_s + 1.0
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
        }
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(request, queue, seqs, head, chat, include_usage, prompt_lens, deadline),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watcher = asyncio.create_task(watch_disconnect(request, seqs))
        texts: list[list[str]] = [[] for _ in seqs]
        toks: list[list[dict]] = [[] for _ in seqs]
        try:
            left = len(seqs)
            while left:
                i, ev = await next_event(queue, seqs, deadline)
                texts[i].append(ev.text)
                if isinstance(ev, TokenEvent):
                    if ev.experts is not None:
                        toks[i].append(routing_token(ev))
                else:
                    left -= 1
        finally:
            watcher.cancel()
            for s in seqs:
                s.cancel()
        for s in seqs:
            metrics.observe(s)
        reasons = [s.finish_reason for s in seqs]
        if "timeout" in reasons:
            raise timeout_error()
        if "error" in reasons:
            raise engine_error(seqs)
        choices = []
        for i, s in enumerate(seqs):
            text = "".join(texts[i])
            choice: dict[str, Any] = {
                "index": i,
                "logprobs": None,
                "finish_reason": s.finish_reason,
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if req.routing:
                choice["routing"] = {"layers": card["moe_layers"], "tokens": toks[i]}
            choices.append(choice)
        head["object"] = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "choices": choices, "usage": usage(seqs, prompt_lens)})

    async def _stream(request, queue, seqs, head, chat, include_usage, prompt_lens, deadline):
        def chunk(choices: list[dict], **extra) -> str:
            return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

        def piece(i: int, text: str, finish: str | None = None, routing=None) -> dict:
            c: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": text} if text or finish is None else {}
            else:
                c["text"] = text
            if routing is not None:
                c["routing"] = {"layers": card["moe_layers"], "tokens": routing}
            return c

        watcher = asyncio.create_task(watch_disconnect(request, seqs))
        try:
            if chat:
                yield chunk(
                    [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                        for i in range(len(seqs))
                    ]
                )  # fmt: skip
            left = len(seqs)
            while left:
                try:
                    i, ev = await next_event(queue, seqs, deadline)
                except APIError as err:
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    break
                if isinstance(ev, TokenEvent):
                    routing = [routing_token(ev)] if ev.experts is not None else None
                    if ev.text or routing:
                        yield chunk([piece(i, ev.text, routing=routing)])
                    continue
                left -= 1
                metrics.observe(seqs[i])
                if ev.reason in ("timeout", "error"):
                    err = timeout_error() if ev.reason == "timeout" else engine_error([seqs[i]])
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    for s in seqs:
                        s.cancel()
                    break
                if ev.text:
                    yield chunk([piece(i, ev.text)])
                yield chunk([piece(i, "", finish=ev.reason)])
            if include_usage:
                yield chunk([], usage=usage(seqs, prompt_lens))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for s in seqs:
                s.cancel()

    # ------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, await read_body(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, await read_body(request, ChatRequest), chat=True)

    def model_entry() -> dict[str, Any]:
        return {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "moelab",
            "moelab": card,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != config.model_name:
            raise APIError(404, f"model: {model_id!r} is not served here", type="not_found_error",
                           param="model", code="model_not_found")  # fmt: skip
        return model_entry()

    @app.get("/health")
    async def health():
        body = {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}
        if not engine.alive:
            return JSONResponse({**body, "status": "engine stopped"}, status_code=503)
        if engine.closed:
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    app.add_middleware(_Guard, config=config, metrics=metrics)
    return app


MAX_JSON_DEPTH = 32
"""Deepest nesting of a request body (OpenAI bodies need 5: messages, parts, ...)."""


def json_problem(obj: dict[str, Any]) -> tuple[str | None, str] | None:
    """``(top-level field, message)`` for a parsed body that nests deeper than
    :data:`MAX_JSON_DEPTH` or holds a string that is not valid Unicode (a lone UTF-16
    surrogate such as ``"\\ud800"``, which JSON can spell but no tokenizer can encode);
    None when it has neither. Walks without recursion."""
    stack: list[tuple[Any, int, str | None]] = [(obj, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return None, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = [(None, v) for v in node]
        else:
            items = [(None, node)]
        for key, value in items:
            top = key if depth == 1 else field
            for text in (key, value):
                if isinstance(text, str) and not _is_unicode(text):
                    name = top or "body"
                    return top, f"{name}: holds a lone surrogate (not valid Unicode text)"
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, top))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(params, seed=seed)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0 = any free port), for
    ``uvicorn_server(...).run(sockets=[sock])``: binding first lets a caller report a busy
    port or an unknown address before it announces the server.

    Raises:
        InvalidValueError: the address cannot be resolved or bound (naming it and why).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise InvalidValueError(f"host: cannot listen on {host!r} ({e.strerror or e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise InvalidValueError(
            f"port: cannot listen on {host}:{port} ({e.strerror or e})"
        ) from None
    return sock


def uvicorn_server(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``server.run()`` serves until SIGINT/SIGTERM (or
    ``server.should_exit = True``), then lets in-flight requests finish for up to
    ``grace_s`` seconds before cancelling them."""
    cfg = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=grace_s,
        access_log=False,
    )
    return uvicorn.Server(cfg)
