"""Autoregressive generation with the model's KV cache, streaming decoded text."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moelab.data import Tokenizer
from moelab.errors import InvalidValueError
from moelab.models import MoETransformer
from moelab.serve.sampling import sample_next


@torch.no_grad()
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
) -> Iterator[int]:
    """Yield new token ids one by one (prefill the prompt once, then one token per step).

    A prompt longer than the context keeps its last ``max_seq_len - 1`` tokens; generation
    stops at ``max_seq_len`` positions, after ``max_new_tokens`` or at ``stop_id``.

    USMoE routing must be causal (``selection_scope`` ``"position"`` or ``"causal_prefix"``;
    the KV cache carries the causal-prefix router state between steps); expert-choice models
    are refused (decoding one token at a time is not the routing they were trained with).

    Raises:
        ValueError: empty prompt, max_new_tokens < 0, bad sampling settings, a USMoE
            router that looks at future tokens, or expert-choice routing.
    """
    if not prompt_ids:
        raise InvalidValueError("prompt: must encode to at least one token")
    if max_new_tokens < 0:
        raise InvalidValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    model._check_cacheable()
    was_training = model.training
    model.eval()
    try:
        limit = model.cfg.max_seq_len
        ids = prompt_ids[-(limit - 1) :] if limit > 1 else prompt_ids[-1:]
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        cache = model.new_kv_cache(1, limit)
        x = torch.tensor([ids], device=device)
        pos = 0
        for _ in range(max_new_tokens):
            if pos + x.shape[1] > limit:
                break
            logits = model(x, kv_cache=cache, start_pos=pos).logits[:, -1]
            pos += x.shape[1]
            nxt = sample_next(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            token = int(nxt.item())
            if stop_id is not None and token == stop_id:
                break
            yield token
            ids.append(token)
            x = nxt.view(1, 1)
    finally:
        model.train(was_training)


def stream_text(tokenizer: Tokenizer, token_ids: Iterator[int]) -> Iterator[str]:
    """Turn a stream of ids into text pieces, holding back incomplete UTF-8 sequences."""
    ids: list[int] = []
    emitted = ""
    for token in token_ids:
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            continue
        yield text[len(emitted) :]
        emitted = text
    text = tokenizer.decode(ids)
    if len(text) > len(emitted):
        yield text[len(emitted) :]
