"""Next-token sampling: temperature, top-k and top-p (nucleus; Holtzman et al. 2020)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row of ``logits`` ``[B, V]``; returns ``[B]`` int64.

    ``temperature == 0`` is greedy decoding (so is any temperature below 1e-6, where the
    division would overflow float32). Otherwise logits are divided by the temperature,
    restricted to the ``top_k`` most likely tokens and then to the smallest set whose
    probability reaches ``top_p`` (the most likely token is always kept), and sampled.

    Raises:
        ValueError: temperature < 0, top_k < 1, or top_p outside (0, 1].
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature < 1e-6:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Validate sampling settings.

    Raises:
        ValueError: temperature not a finite number >= 0, top_k < 1, or top_p outside (0, 1].
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidValueError(f"temperature: must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise InvalidValueError(f"top_k: must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidValueError(f"top_p: must be in (0, 1], got {top_p}")


def filtered_logits(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> Tensor:
    """Float32 ``logits [..., V]`` divided by ``temperature`` (> 0), with every token outside
    the top-k and then outside the top-p nucleus set to ``-inf`` (the most likely token is
    always kept). Arguments are not validated here (see :func:`sample_next`)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
