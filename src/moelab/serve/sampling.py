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
        ValueError: as :func:`check_sampling`.
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature < 1e-6:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Validate sampling settings as :func:`filtered_logits` uses them: in float32, so a
    value that passes here cannot turn into 0 or inf there (``top_p = 1e-300`` is a
    positive double but 0 in float32, which would mask out every token).

    Raises:
        ValueError: temperature not a number >= 0 that is finite in float32, top_k not an
            int >= 1, or top_p not in (0, 1] with a float32 value above 0.
    """
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)):
        raise InvalidValueError(f"temperature: must be a number, got {temperature!r}")
    if not (math.isfinite(_f32(temperature)) and temperature >= 0):
        raise InvalidValueError(
            f"temperature: must be a number >= 0 that is finite in float32, got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InvalidValueError(f"top_k: must be an int >= 1, got {top_k!r}")
    if top_p is not None and not (
        isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1
    ):
        raise InvalidValueError(f"top_p: must be in (0, 1], got {top_p!r}")
    if top_p is not None and _f32(top_p) <= 0:
        raise InvalidValueError(
            f"top_p: {top_p} is 0 in float32, the precision sampling runs in; "
            f"use at least {_F32_TINY:.3g}"
        )


_F32_TINY = float(torch.finfo(torch.float32).smallest_normal)
"""Smallest normal float32: the smallest ``top_p`` the message suggests (any positive
float32 works; subnormals may be flushed to 0 on some hardware)."""


def _f32(x: float) -> float:
    """``x`` rounded to float32 (overflow gives ``inf``, underflow ``0.0``)."""
    return torch.tensor(float(x), dtype=torch.float32).item()


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
        drop_sorted[..., 0] = False  # the most likely token stays, whatever top_p rounds to
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
