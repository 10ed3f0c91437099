"""Greedy generation of many prompts at once through moelab's serving engine (continuous
batching with a KV cache), so evaluation takes the same code path as ``moelab serve``."""

from __future__ import annotations

from collections.abc import Sequence

from moelab.models.transformer import MoETransformer
from moelab.serve.engine import Engine
from moelab.serve.params import SamplingParams


def greedy_batch(
    model: MoETransformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_id: int | None = None,
    max_batch: int = 16,
) -> list[list[int]]:
    """Greedy continuations (token ids, ``stop_id`` excluded) of ``prompts``, in order.

    Raises:
        RuntimeError: a sequence ended in an engine error (its message).
    """
    was_training = model.training
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=0.0, stop_ids=() if stop_id is None else (stop_id,)
    )
    engine = Engine(model, max_batch=max_batch, max_queue=max(len(prompts), 1), track_experts=False)
    seqs = [engine.submit(list(p), params) for p in prompts]
    try:
        while not all(s.done.is_set() for s in seqs):
            engine.step()
    finally:
        model.train(was_training)
    for s in seqs:
        if s.finish_reason == "error":
            raise RuntimeError(s.error or "engine: generation failed")
    return [[t for t in s.output_ids if t != stop_id] for s in seqs]
