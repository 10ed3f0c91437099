"""Validation: loss (nats/token), perplexity and bits per byte, overall and per domain."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from moelab.data import TokenStream, eval_batches
from moelab.data.batching import Batch
from moelab.errors import NonFiniteOutputError
from moelab.models import MoETransformer


@dataclass
class DomainScore:
    """Loss of one slice of the validation text.

    Attributes:
        loss: mean cross-entropy in nats per token.
        bits_per_byte: total nats / ln 2 / total UTF-8 bytes of the predicted text.
        tokens, bytes: how much text was scored.
    """

    loss: float
    bits_per_byte: float
    tokens: int
    bytes: int

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (``inf`` beyond the float range)."""
        return math.exp(self.loss) if self.loss < 709.0 else math.inf


@dataclass
class EvalResult:
    """Overall score plus one :class:`DomainScore` per domain present in the text."""

    overall: DomainScore
    per_domain: dict[str, DomainScore] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-able dict; a non-finite number (an overflowing perplexity) becomes ``None``."""

        def row(score: DomainScore) -> dict:
            d = {**asdict(score), "perplexity": score.perplexity}
            return {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in d.items()
            }

        return {
            "overall": row(self.overall),
            "per_domain": {k: row(v) for k, v in self.per_domain.items()},
        }


def _score(nats: float, tokens: int, n_bytes: int) -> DomainScore:
    return DomainScore(
        loss=nats / max(tokens, 1),
        bits_per_byte=nats / math.log(2) / max(n_bytes, 1),
        tokens=tokens,
        bytes=n_bytes,
    )


@torch.no_grad()
def evaluate(
    model: MoETransformer,
    streams: Mapping[str, TokenStream],
    *,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    doc_masks: bool = False,
    nats_fn: Callable[[MoETransformer, Batch], float] | None = None,
) -> EvalResult:
    """Score each named stream with non-overlapping windows of ``seq_len`` tokens.

    Each stream (one per domain for the ``mix`` corpus) is scored up to ``max_tokens``
    tokens, so every domain is measured even when the budget is small. Bits per byte uses the
    exact UTF-8 bytes of every predicted token (``Batch.target_bytes``), so it is comparable
    across tokenizers; ``overall`` pools all streams. With ``doc_masks`` each document of a
    window attends only to itself (as a run trained with ``TrainConfig.doc_masks``).

    ``nats_fn(model, batch)`` replaces the causal cross-entropy with another summed score in
    nats of ``batch.targets`` (the block-diffusion ELBO of :mod:`moelab.train.diffusion`).

    Raises:
        CorpusError: a stream is shorter than ``seq_len + 1`` tokens.
        NonFiniteOutputError: the loss of a batch is not finite (NaN/inf weights or
            activations), naming the stream; no score is returned.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    totals: dict[str, list[float]] = {}
    try:
        for name, stream in streams.items():
            nats, tokens, n_bytes = 0.0, 0, 0
            for batch in eval_batches(stream, batch_size, seq_len, max_tokens):
                batch = batch.to(device)
                if nats_fn is not None:
                    value = nats_fn(model, batch)
                else:
                    doc_ids = batch.doc_ids if doc_masks else None
                    logits = model(batch.input_ids, doc_ids=doc_ids).logits.float()
                    value = F.cross_entropy(
                        logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"
                    ).item()
                if not math.isfinite(value):
                    raise NonFiniteOutputError(
                        f"{name}: the model's loss is not finite ({value}) after "
                        f"{tokens} tokens; its weights or activations hold NaN or inf"
                    )
                nats += value
                tokens += batch.targets.numel()
                n_bytes += int(batch.target_bytes.sum())
            totals[name] = [nats, tokens, n_bytes]
    finally:
        model.train(was_training)
    per_domain = {name: _score(*t) for name, t in totals.items()}
    overall = _score(*(sum(t[i] for t in totals.values()) for i in range(3)))
    return EvalResult(overall=overall, per_domain=per_domain)
