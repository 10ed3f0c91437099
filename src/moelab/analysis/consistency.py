"""Positional and temporal routing consistency.

* Adjacent-token consistency: the fraction of consecutive tokens of one sequence whose top-1
  expert is the same, the "repeated consecutive assignments" measure of the Mixtral routing
  analysis (Jiang et al., "Mixtral of Experts", 2024, arXiv:2401.04088, Sec. 5, Table 5).
* Route stability across decoding steps: the fraction of token positions whose top-1 expert is
  the same in two forward passes over the same positions (e.g. two denoising steps of a
  masked-diffusion LM, or two prefix lengths of an autoregressive decode). This is this
  project's definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from moelab.analysis._common import check_records, safe_div
from moelab.core.telemetry import RoutingRecord


@dataclass(frozen=True)
class Agreement:
    """``fraction = matches / pairs`` (0.0 when there is no pair to compare)."""

    fraction: float
    matches: int
    pairs: int

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "matches": self.matches, "pairs": self.pairs}


def _as_sequences(x: Tensor, batch_shape: tuple[int, ...]) -> Tensor:
    """Reshape ``[T]`` to ``[num_sequences, S]``: the last batch dim is the sequence axis."""
    if len(batch_shape) == 0:
        return x.reshape(1, -1)
    return x.reshape(-1, batch_shape[-1])


def adjacent_agreement_counts(record: RoutingRecord) -> tuple[int, int]:
    """``(matches, pairs)`` of adjacent valid positions ``(s, s+1)`` in each sequence.

    The record's ``batch_shape`` gives the layout: ``(B, S)`` means B sequences of S tokens
    (a 1-D ``(T,)`` is one sequence; for more dims the last is the sequence axis). A pair counts
    only when both positions are valid in ``token_mask``.
    """
    T = record.probs.shape[0]
    prod = 1
    for d in record.batch_shape:
        prod *= int(d)
    if prod != T:
        raise ValueError(f"batch_shape {record.batch_shape} does not multiply to T={T}")
    top1 = _as_sequences(record.top1.cpu(), record.batch_shape)
    mask = _as_sequences(record.token_mask.bool().cpu(), record.batch_shape)
    both = mask[:, 1:] & mask[:, :-1]
    same = (top1[:, 1:] == top1[:, :-1]) & both
    return int(same.sum()), int(both.sum())


def adjacent_consistency(records: Sequence[RoutingRecord]) -> Agreement:
    """Fraction of adjacent valid token pairs within a sequence that share their top-1 expert.

    ``Σ_records Σ_(b,s) [top1[b,s] = top1[b,s+1]] / Σ_records #{(b,s): both valid}``. Its chance
    level under independent routing is ``Σ_e f_e²`` (1/E for uniform top-1 usage).
    """
    check_records(records)
    m = n = 0
    for r in records:
        a, b = adjacent_agreement_counts(r)
        m += a
        n += b
    return Agreement(fraction=safe_div(m, n), matches=m, pairs=n)


def route_stability(record_a: RoutingRecord, record_b: RoutingRecord) -> Agreement:
    """Fraction of token positions valid in both records whose top-1 expert agrees.

    ``record_a`` and ``record_b`` are the same layer on the same T token positions at two
    decoding steps. ``fraction = #{t valid in both: top1_a[t] = top1_b[t]} / #{t valid in both}``.

    Raises:
        ValueError: when the records differ in T.
    """
    check_records([record_a, record_b], "[record_a, record_b]")
    if record_a.probs.shape[0] != record_b.probs.shape[0]:
        raise ValueError(
            f"record_a has T={record_a.probs.shape[0]} tokens but record_b has "
            f"T={record_b.probs.shape[0]}; route stability needs the same positions"
        )
    mask = (record_a.token_mask.bool() & record_b.token_mask.bool()).cpu()
    same = (record_a.top1.cpu() == record_b.top1.cpu()) & mask
    m, n = int(same.sum()), int(mask.sum())
    return Agreement(fraction=safe_div(m, n), matches=m, pairs=n)
