"""``moelab eval``: loss, perplexity and bits per byte of a run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._common import summary_table
from moelab.cli._offload import (
    CacheMb,
    OffloadFlag,
    Policy,
    StorageMbps,
    load_for_inference,
    report_offload,
)
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError


@app.command("eval")
def eval_cmd(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    data: Annotated[
        str | None, Opt(help="Corpus to score (default: the run's validation split).")
    ] = None,
    tokens: Annotated[int, Opt(help="Maximum tokens to score."), Range(min=1)] = 262_144,
    batch_size: Annotated[int, Opt(help="Sequences per batch."), Range(min=1)] = 16,
    as_json: Annotated[bool, Opt("--json", help="Print JSON.")] = False,
    allow_noncausal_routing: Annotated[
        bool, Opt(help="Score a model whose routing looks at future tokens (not a causal LM).")
    ] = False,
    offload: OffloadFlag = False,
    cache_mb: CacheMb = None,
    policy: Policy = "zipmoe",
    storage_mbps: StorageMbps = None,
    reference: Annotated[
        Path | None,
        Opt(
            help="Also score this causal run on the same text (default for a block-diffusion "
            "run: the run it was initialised from)."
        ),
    ] = None,
) -> None:
    """Loss, perplexity and bits per byte of a run (per domain for the mix corpus).

    A block-diffusion run is scored by its ELBO (an upper bound on its bits per byte), next to
    the causal run it was initialised from.

    Examples:
      moelab eval runs/main
      moelab eval runs/main --data kjv --json
      moelab eval runs/main-zip --offload --cache-mb 4 --tokens 8192
      moelab eval runs/bd --reference runs/main      # diffusion ELBO next to the AR model
    """
    offload_args = (offload, cache_mb, policy, storage_mbps)
    result, noncausal, model, seconds = guarded(
        _evaluate_run, run, data, tokens, batch_size, allow_noncausal_routing, offload_args
    )
    report_offload(model, result.overall.tokens, seconds)
    ref_run = guarded(_reference_run, run, model, reference)
    ref = None
    if ref_run is not None:
        ref, *_ = guarded(_evaluate_run, ref_run, data, tokens, batch_size, False, scored_as=run)
    notes = []
    if noncausal:
        notes.append(
            f"not a causal LM score: MoE layers {noncausal} route with USMoE scopes that look "
            "at future tokens"
        )
    if model.cfg.objective == "block_diffusion":
        notes.append("block diffusion: the ELBO, an upper bound on bits/byte")
    note = "; ".join(notes) or None
    extra = {"note": note} if note else {}
    if ref is not None:
        extra["reference"] = {"run": str(ref_run), **ref.to_dict()}
    from moelab.serve.offload import offload_engine

    engine = offload_engine(model)
    if engine is not None:
        extra["offload"] = {**engine.snapshot().to_dict(), "seconds": seconds}
    if as_json:
        console.print_json(json.dumps({**result.to_dict(), **extra}))
    else:
        title = f"{run}: {'validation split' if data is None else data}"
        console.print(summary_table(title + (f" ({note})" if note else ""), result, ref, ref_run))


def _evaluate_run(
    run: Path,
    data: str | None,
    tokens: int,
    batch_size: int,
    allow_noncausal: bool,
    offload_args: tuple = (False, None, "zipmoe", None),
    scored_as: Path | None = None,
):
    """(EvalResult, indices of MoE layers whose routing looks at future tokens, model,
    seconds the scoring took, loading excluded).

    ``scored_as``: take the text (validation split, sequence length) from this run instead,
    so a reference model is scored on the same documents (with its own tokenizer)."""
    from moelab.data import TokenStream, load_corpus
    from moelab.train.evaluate import evaluate
    from moelab.train.loop import run_train_config, validation_streams

    model, tokenizer = load_for_inference(run, *offload_args)
    noncausal = model.noncausal_routing_layers()
    if noncausal and not allow_noncausal:
        raise InvalidValueError(
            f"router: MoE layers {noncausal} route with a USMoE scope that looks at future "
            "tokens, so bits/byte would not be a causal LM score; pass "
            "--allow-noncausal-routing to score it anyway"
        )
    cfg = run_train_config(scored_as or run, need_data=data is None)
    seq_len = min(cfg.seq_len, model.cfg.max_seq_len)
    if data is None:
        streams = validation_streams(cfg, tokenizer)
    else:
        streams = {data: TokenStream.from_documents(load_corpus(data), tokenizer, name=data)}
    from moelab.train.diffusion import batch_elbo_nats  # block diffusion: the ELBO bound

    nats_fn = batch_elbo_nats if model.cfg.objective == "block_diffusion" else None
    start = time.perf_counter()
    result = evaluate(
        model, streams, seq_len=seq_len, batch_size=batch_size, max_tokens=tokens,
        doc_masks=cfg.doc_masks, nats_fn=nats_fn,
    )  # fmt: skip
    return result, noncausal, model, time.perf_counter() - start


def _reference_run(run: Path, model, reference: Path | None) -> Path | None:
    """The causal run to score next to ``run``: ``reference``, or for a block-diffusion run
    the ``init_from`` of its training when that folder still exists (else None).

    Raises:
        FileNotFoundError: ``reference`` does not exist.
    """
    from moelab.train.loop import run_train_config

    if reference is not None:
        if not reference.exists():
            raise FileNotFoundError(f"{reference}: reference run not found")
        return reference
    if model.cfg.objective != "block_diffusion":
        return None
    init = run_train_config(run).init_from
    return Path(init) if init and Path(init).is_dir() else None
