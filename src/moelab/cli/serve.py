"""``moelab serve``: an OpenAI-compatible HTTP server over the batching engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._chat import chat_template_for
from moelab.cli._compile import CompileFlag, FusedFlag, check_compile
from moelab.cli._diffusion import Decoder, Threshold, decode_options
from moelab.cli._offload import CacheMb, OffloadFlag, Policy, StorageMbps, load_for_inference
from moelab.cli._ranges import Range


def _offload_stats(model):
    """``/metrics`` gauges of an offloaded model's expert cache (hit rates per tier, bytes
    read, decode seconds)."""
    from moelab.serve.offload import offload_engine

    engine = offload_engine(model)

    def stats() -> dict[str, float]:
        s = engine.snapshot()
        req = max(s.requests, 1)
        return {
            "expert_requests": float(s.requests),
            "expert_cache_hit_rate_full": s.hits_full / req,
            "expert_cache_hit_rate_sign_mantissa": s.hits_sm / req,
            "expert_cache_miss_rate": s.misses / req,
            "expert_bytes_read": float(s.bytes_read),
            "expert_decode_seconds": s.decode_s,
        }

    return stats


@app.command()
def serve(
    run: Annotated[
        Path, typer.Argument(help="Run folder, model folder, or a pretrained name (smollm2).")
    ],
    host: Annotated[
        str, Opt(help="Address to bind (127.0.0.1 = this machine only).")
    ] = "127.0.0.1",
    port: Annotated[int, Opt(help="TCP port (0 = any free port)."), Range(0, 65535)] = 8000,
    max_batch: Annotated[int, Opt(help="Most sequences decoding at once."), Range(min=1)] = 16,
    max_queue: Annotated[
        int, Opt(help="Most requests waiting for a slot (then 429)."), Range(min=1)
    ] = 256,
    api_key: Annotated[
        str | None, Opt(envvar="MOELAB_API_KEY", help="Require 'Authorization: Bearer KEY'.")
    ] = None,
    model_name: Annotated[
        str | None, Opt(help="The model id clients send (default: the run folder's name).")
    ] = None,
    timeout: Annotated[
        float, Opt(help="Seconds before a request is cancelled (0 = none)."), Range(min=0)
    ] = 600.0,
    max_body_kb: Annotated[
        int, Opt(help="Largest request body in KiB (then 413)."), Range(min=1)
    ] = 1024,
    grace: Annotated[
        float, Opt(help="Seconds in-flight requests get on SIGTERM/Ctrl-C."), Range(min=0)
    ] = 30.0,
    offload: OffloadFlag = False,
    cache_mb: CacheMb = None,
    policy: Policy = "zipmoe",
    storage_mbps: StorageMbps = None,
    decoder: Decoder = "causal",
    threshold: Threshold = 0.95,
    compile: CompileFlag = False,
    fused: FusedFlag = False,
) -> None:
    """Serve a model over HTTP with the OpenAI API (completions, chat, streaming).

    Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    (Prometheus) and / (a page that colours each generated token by its experts).
    Requests may add "routing": true to get the experts of every token.

    Examples:
      moelab serve runs/main --port 8000 --max-batch 16
      moelab serve runs/smollm2-moe --host 0.0.0.0 --api-key secret
      moelab serve runs/main-zip --offload --cache-mb 8      # experts from a lossless store
      moelab serve runs/bd --decoder team --threshold 0.9    # a block-diffusion model, TEAM
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "main", "prompt": "ROMEO:", "max_tokens": 40}'
    """
    import json

    from moelab.serve import Engine
    from moelab.serve.card import model_card
    from moelab.serve.diffusion import DiffusionEngine
    from moelab.serve.server import (
        ServerConfig,
        bind_socket,
        build_app,
        check_api_key,
        uvicorn_server,
    )

    if api_key is None and "MOELAB_API_KEY" in os.environ:  # click reads "" as unset
        api_key = os.environ["MOELAB_API_KEY"]
    if api_key is not None:  # an empty key is refused, never read as "no authentication"
        guarded(check_api_key, api_key)
    guarded(check_compile, compile, offload, decoder, fused)
    model, tokenizer = guarded(load_for_inference, run, offload, cache_mb, policy, storage_mbps)
    offload_stats = _offload_stats(model) if offload else None
    name = model_name or run.resolve().name
    template = guarded(chat_template_for, run)
    options = guarded(decode_options, model, decoder, threshold)
    limits = {"max_batch": max_batch, "max_queue": max_queue}
    if options is None:
        engine = guarded(Engine, model, tokenizer, compile=compile, fused=fused, **limits)
    else:
        engine = guarded(DiffusionEngine, model, tokenizer, options=options, **limits)
    config = ServerConfig(
        model_name=name,
        api_key=api_key,
        max_body_bytes=max_body_kb * 1024,
        request_timeout_s=timeout or None,
        shutdown_grace_s=grace,
    )
    card = model_card(model, name)
    app_ = build_app(
        engine, tokenizer, config, card=card, chat_template=template, offload_stats=offload_stats
    )
    sock = guarded(bind_socket, host, port)  # a busy port is reported before the banner
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    console.print(f"[bold]moelab serve[/] {name}: http://{shown}:{port}/  (OpenAI API at /v1)")
    console.print(json.dumps(card))
    console.print(
        f"max batch {max_batch}, queue {max_queue}, "
        + (f"decoder {decoder} (τ = {threshold}), " if options is not None else "")
        + "chat template: "
        f"{'plain' if template.is_plain else 'from the model folder'}"
        + (", API key required" if api_key else "")
    )
    uvicorn_server(app_, host=host, port=port, grace_s=grace).run(sockets=[sock])
