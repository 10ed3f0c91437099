"""Serving: the continuous-batching generation engine, sampling, and (in
:mod:`moelab.serve.server`, which needs the ``serve`` extra: FastAPI, uvicorn,
prometheus-client) the OpenAI-compatible HTTP server with metrics and a routing page."""

from moelab.serve.engine import (
    Engine,
    EngineClosedError,
    FinishEvent,
    QueueFullError,
    Sequence,
    TokenEvent,
)
from moelab.serve.kv_slots import SlotKVCache
from moelab.serve.params import SamplingParams

__all__ = [
    "Engine",
    "EngineClosedError",
    "FinishEvent",
    "QueueFullError",
    "SamplingParams",
    "Sequence",
    "SlotKVCache",
    "TokenEvent",
]
