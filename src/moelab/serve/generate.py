"""Single-sequence generation (through the batched engine) and streamed text."""

from __future__ import annotations

from collections.abc import Iterator

from moelab.data import Tokenizer
from moelab.errors import InvalidValueError, NonFiniteOutputError
from moelab.models import MoETransformer
from moelab.serve.detok import Detokenizer
from moelab.serve.engine import Engine, TokenEvent
from moelab.serve.params import SamplingParams


def generate_ids(
    model: MoETransformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = 0.95,
    seed: int = 0,
    stop_id: int | None = None,
    compile: bool = False,
    fused: bool = False,
) -> Iterator[int]:
    """Yield new token ids one by one (prefill the prompt once, then one token per step).

    Runs a one-slot :class:`~moelab.serve.engine.Engine`, so a sequence generated alone and
    the same sequence in a served batch take the same code path. A prompt longer than the
    context keeps its last ``max_seq_len - 1`` tokens; generation stops at ``max_seq_len``
    positions, after ``max_new_tokens`` or at ``stop_id``.

    USMoE routing must be causal (``selection_scope`` ``"position"`` or ``"causal_prefix"``,
    both decoded incrementally); layers with a capacity factor are served dropless
    (:mod:`moelab.serve.batching`);
    expert-choice models are refused (decoding one token at a time is not the routing they
    were trained with). ``compile`` runs the decode steps compiled, ``fused`` as one C++ call
    each (:class:`Engine`'s ``compile`` and ``fused``).

    Raises:
        ValueError: empty prompt, max_new_tokens < 0, bad sampling settings, a USMoE
            router that looks at future tokens, or expert-choice routing.
        NonFiniteOutputError: the model's logits are not finite (NaN/inf weights); raised
            before any token is sampled from them.
        Exception: whatever a forward pass or the sampling raised inside the engine (after
            the tokens generated before it were yielded).
    """
    if not prompt_ids:
        raise InvalidValueError("prompt: must encode to at least one token")
    if max_new_tokens < 0:
        raise InvalidValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    params = SamplingParams(
        max_tokens=max(max_new_tokens, 1),
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop_ids=() if stop_id is None else (stop_id,),
    )
    model._check_cacheable()  # raises for non-causal USMoE and expert-choice routing
    if max_new_tokens == 0:
        return
    limit = model.cfg.max_seq_len
    ids = prompt_ids[-(limit - 1) :] if limit > 1 else prompt_ids[-1:]
    was_training = model.training
    try:
        engine = Engine(model, max_batch=1, max_queue=1, track_experts=False, compile=compile,
                        fused=fused)  # fmt: skip
        out: list[int] = []
        seq = engine.submit(
            ids, params, lambda ev: out.append(ev.token_id) if isinstance(ev, TokenEvent) else None
        )
        sent = 0
        while not seq.done.is_set():
            engine.step()
            while sent < len(out):
                yield out[sent]
                sent += 1
        yield from out[sent:]
        if seq.finish_reason == "error":
            if seq.exception is not None:  # the engine contained it; here it is ours to raise
                raise seq.exception
            raise NonFiniteOutputError(seq.error or "engine: generation failed")
    finally:
        model.train(was_training)


def stream_text(tokenizer: Tokenizer, token_ids: Iterator[int]) -> Iterator[str]:
    """Turn a stream of ids into text pieces, holding back incomplete UTF-8 sequences."""
    detok = Detokenizer(tokenizer)
    for token in token_ids:
        piece = detok.push(token)[0]
        if piece:
            yield piece
    tail = detok.flush()
    if tail:
        yield tail
