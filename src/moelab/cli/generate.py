"""``moelab generate``: continue a prompt, streaming tokens as they are sampled."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import Opt, app, err_console, guarded
from moelab.cli._compile import CompileFlag, FusedFlag, check_compile
from moelab.cli._diffusion import Decoder, Threshold, decode_options
from moelab.cli._offload import (
    CacheMb,
    OffloadFlag,
    Policy,
    StorageMbps,
    load_for_inference,
    report_offload,
)
from moelab.cli._ranges import SEED, Range
from moelab.errors import InvalidValueError


@app.command()
def generate(
    run: Annotated[
        Path, typer.Argument(help="Run folder, model folder, or a pretrained name (smollm2).")
    ],
    prompt: Annotated[str, Opt(help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[int, Opt(help="Tokens to generate."), Range(min=0)] = 200,
    temperature: Annotated[
        float, Opt(help="Sampling temperature (0 = greedy)."), Range(min=0)
    ] = 0.8,
    top_k: Annotated[int, Opt(help="Keep the k most likely tokens (0 = off)."), Range(min=0)] = 50,
    top_p: Annotated[
        float, Opt(help="Nucleus probability mass (1 = off)."), Range(min=0, max=1, min_open=True)
    ] = 0.95,
    seed: Annotated[int, Opt(help="Sampling seed."), SEED] = 0,
    offload: OffloadFlag = False,
    cache_mb: CacheMb = None,
    policy: Policy = "zipmoe",
    storage_mbps: StorageMbps = None,
    decoder: Decoder = "causal",
    threshold: Threshold = 0.95,
    compile: CompileFlag = False,
    fused: FusedFlag = False,
) -> None:
    """Continue a prompt, streaming tokens as they are sampled.

    Examples:
      moelab generate runs/main --prompt "ROMEO:" --max-new-tokens 300
      moelab generate runs/main --prompt "def main(" --temperature 0
      moelab generate runs/main --max-new-tokens 2000 --compile
      moelab generate runs/main --max-new-tokens 2000 --fused
      moelab generate runs/main-zip --offload --cache-mb 4 --storage-mbps 200
      moelab generate runs/bd --decoder team --threshold 0.9 --temperature 0 --prompt "A 123+456="
    """
    import torch

    from moelab.serve.diffusion import sampling_picker
    from moelab.serve.engine import check_compilable
    from moelab.serve.fused import check_fusable
    from moelab.serve.generate import generate_ids, stream_text

    guarded(check_compile, compile, offload, decoder, fused)
    guarded(_check_request, prompt, max_new_tokens, temperature, top_k or None, top_p)
    model, tokenizer = guarded(load_for_inference, run, offload, cache_mb, policy, storage_mbps)
    if compile:
        guarded(check_compilable, model)
    if fused:
        guarded(check_fusable, model.eval(), served=True)  # as the engine serves it
    options = guarded(decode_options, model, decoder, threshold)
    if options is not None:
        pick = sampling_picker(  # settings checked by _check_request
            temperature, top_k or None, top_p, torch.Generator().manual_seed(seed)
        )
        guarded(_diffusion, model, tokenizer, prompt, max_new_tokens, options, pick)
        return

    def go() -> None:
        prompt_ids = tokenizer.encode(prompt)
        ids = generate_ids(
            model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k or None, top_p=top_p, seed=seed, stop_id=tokenizer.eot_id, compile=compile,
            fused=fused,
        )  # fmt: skip
        counted = _Counted(ids)
        start = time.perf_counter()
        sys.stdout.write(prompt)
        for piece in stream_text(tokenizer, counted):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        report_offload(model, counted.n, time.perf_counter() - start)
        if counted.n < max_new_tokens and len(prompt_ids) + counted.n >= model.cfg.max_seq_len:
            err_console.print(
                f"[yellow]stopped after {counted.n} tokens: the context holds {model.cfg.max_seq_len}[/]"
            )

    guarded(go)


def _diffusion(model, tokenizer, prompt, max_new_tokens, options, pick) -> None:
    """Block-diffusion decoding; counters go to stderr."""
    from moelab.serve.diffusion import diffusion_generate

    start = time.perf_counter()
    res = diffusion_generate(
        model, tokenizer.encode(prompt), max_new_tokens=max_new_tokens, options=options,
        stop_id=tokenizer.eot_id, pick=pick,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    sys.stdout.write(prompt + tokenizer.decode(res.ids) + "\n")
    s = res.stats
    err_console.print(
        f"NFE {s.nfe}  TPF {s.tpf:.2f}  APF {s.apf:.2f}  APT {s.apt:.2f}  "
        f"{s.tokens_per_s:.1f} tok/s"
    )
    report_offload(model, len(res.ids), seconds)


class _Counted:
    """An iterator wrapper that counts what it yields."""

    def __init__(self, it) -> None:
        self.it, self.n = it, 0

    def __iter__(self):
        for x in self.it:
            self.n += 1
            yield x


def _check_request(
    prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    """Checks made before anything is printed (generation itself starts lazily, after the
    prompt is echoed).

    Raises:
        ValueError: ``prompt`` holds bytes that are not UTF-8 (the shell passes them on as
            surrogate escapes, which the tokenizers refuse with a TypeError), a negative
            ``max_new_tokens``, or bad sampling settings.
    """
    from moelab.serve.sampling import check_sampling

    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidValueError("prompt: not valid UTF-8 text") from None
    if max_new_tokens < 0:
        raise InvalidValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
