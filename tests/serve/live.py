"""A live server on 127.0.0.1 (random free port) in a background thread, for the tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch

from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer
from moelab.serve import Engine
from moelab.serve.card import model_card
from moelab.serve.server import ServerConfig, build_app, uvicorn_server


def tiny_byte_model(seed: int = 0, max_seq_len: int = 128) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=max_seq_len)).eval()


@contextlib.contextmanager
def live_server(model=None, *, step_delay: float = 0.0, max_batch: int = 4, max_queue: int = 8,
                make_engine=Engine, **config):  # fmt: skip
    """Yield ``(base_url, engine)``; ``step_delay`` slows every engine iteration (seconds);
    ``make_engine(model, tokenizer, max_batch=, max_queue=)`` builds the engine."""
    model = model if model is not None else tiny_byte_model()
    tok = ByteTokenizer()
    engine = make_engine(model, tok, max_batch=max_batch, max_queue=max_queue)
    if step_delay:
        step = engine.step

        def slow_step() -> None:
            time.sleep(step_delay)
            step()

        engine.step = slow_step
    config.setdefault("model_name", "tiny")
    app = build_app(engine, tok, ServerConfig(**config), card=model_card(model, "tiny"))
    server = uvicorn_server(app, port=0, grace_s=5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()


def wait_until(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()
