"""Token streams of one split and the batches a language model trains and evaluates on.

A :class:`TokenStream` is every document of a split encoded and concatenated. After each
document comes the tokenizer's end-of-text token when it has one (BPE: ``<|endoftext|>``,
0 bytes), otherwise a newline (bytes: one ``\\n`` byte, counted as 1 byte of text). So for
:class:`~moelab.data.tokenizer.ByteTokenizer`, tokens == bytes.

Bits per byte: every batch carries ``target_bytes``, the UTF-8 bytes each target token stands
for, so ``bpb = sum(nats) / ln 2 / sum(target_bytes)`` exactly, also per domain
(mask by ``domains``). :func:`eval_coverage` gives the totals of :func:`eval_batches` up front.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moelab.data.corpora import Document
from moelab.data.errors import CorpusError
from moelab.data.tokenizer import Tokenizer
from moelab.errors import InvalidValueError


@dataclass(frozen=True)
class TokenStream:
    """One split as a flat token sequence.

    Attributes:
        ids: ``[N]`` int64 token ids.
        domains: ``[N]`` uint8 domain id of each token (index into ``domain_names``).
        domain_names: names of the domain ids.
        token_bytes: ``[vocab_size]`` int64 UTF-8 bytes per token id (0 for special tokens).
        n_bytes: UTF-8 bytes of the whole stream's text (documents plus newline separators).
        name: label used in error messages (e.g. ``"train"``, ``"val"``).
        doc_index: ``[N]`` int64 ordinal of the document each token belongs to (its separator
            included), for document masks on packed windows; None when unknown.
    """

    ids: Tensor
    domains: Tensor
    domain_names: tuple[str, ...]
    token_bytes: Tensor
    n_bytes: int
    name: str = "stream"
    doc_index: Tensor | None = None

    @classmethod
    def from_documents(
        cls,
        docs: Sequence[Document],
        tokenizer: Tokenizer,
        *,
        domain_names: Sequence[str] | None = None,
        name: str = "stream",
    ) -> TokenStream:
        """Encode and concatenate ``docs`` in order.

        Args:
            docs: the documents of one split.
            tokenizer: any :class:`~moelab.data.tokenizer.Tokenizer`.
            domain_names: the domain id order; pass the same list (e.g. the sorted domains of
                the whole corpus) for train and val so ids agree. Default: sorted domains of
                ``docs``.
            name: label for error messages.

        Raises:
            CorpusError: ``docs`` is empty or encodes to no token.
            ValueError: a document's domain is not in ``domain_names``, or more than 256 domains.
        """
        if not docs:
            raise CorpusError(f"{name}: no documents to encode")
        names = (
            tuple(domain_names)
            if domain_names is not None
            else tuple(sorted({d.domain for d in docs}))
        )
        if len(names) > 256:
            raise InvalidValueError(f"at most 256 domains are supported, got {len(names)}")
        domain_id = {d: i for i, d in enumerate(names)}
        missing = sorted({d.domain for d in docs} - domain_id.keys())
        if missing:
            raise InvalidValueError(
                f"{name}: domains {missing} are not in domain_names {list(names)}"
            )

        eot = tokenizer.eot_id
        sep = np.asarray([eot] if eot is not None else tokenizer.encode("\n"), dtype=np.int64)
        sep_bytes = 0 if eot is not None else 1
        pieces: list[np.ndarray] = []
        dom_pieces: list[np.ndarray] = []
        lengths: list[int] = []
        n_bytes = 0
        for doc, ids in zip(docs, tokenizer.encode_arrays(d.text for d in docs), strict=True):
            ids = np.concatenate([ids, sep])
            pieces.append(ids)
            dom_pieces.append(np.full(len(ids), domain_id[doc.domain], dtype=np.uint8))
            lengths.append(len(ids))
            n_bytes += doc.n_bytes + sep_bytes
        return cls(
            ids=torch.from_numpy(np.concatenate(pieces)),
            domains=torch.from_numpy(np.concatenate(dom_pieces)),
            domain_names=names,
            token_bytes=torch.from_numpy(tokenizer.token_byte_lengths()),
            n_bytes=n_bytes,
            name=name,
            doc_index=torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)),
        )

    def __len__(self) -> int:
        return int(self.ids.numel())

    @property
    def n_tokens(self) -> int:
        """Number of tokens ``N``."""
        return len(self)

    @property
    def bytes_per_token(self) -> float:
        """``n_bytes / n_tokens``: ``bpb = nats_per_token / ln 2 / bytes_per_token``."""
        return self.n_bytes / self.n_tokens


@dataclass(frozen=True)
class Batch:
    """A batch of next-token prediction windows (all CPU tensors until :meth:`to`).

    Attributes:
        input_ids: ``[B, S]`` int64.
        targets: ``[B, S]`` int64, ``targets[:, s]`` is the token after ``input_ids[:, s]``.
        domains: ``[B, S]`` int64 domain id of each *target* token.
        target_bytes: ``[B, S]`` int64 UTF-8 bytes each target token stands for.
        doc_ids: ``[B, S]`` int64 document of each *input* token (for
            ``MoETransformer(..., doc_ids=...)``: attention and sequence losses per
            document), or None when the stream does not know its documents.
    """

    input_ids: Tensor
    targets: Tensor
    domains: Tensor
    target_bytes: Tensor
    doc_ids: Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch on ``device``."""
        fields = (self.input_ids, self.targets, self.domains, self.target_bytes, self.doc_ids)
        return Batch(
            *(None if t is None else t.to(device, non_blocking=non_blocking) for t in fields)
        )


@dataclass(frozen=True)
class EvalCoverage:
    """What :func:`eval_batches` covers: ``n_windows`` windows, ``n_tokens`` target tokens
    (``n_windows * seq_len``) standing for ``n_bytes`` UTF-8 bytes."""

    n_windows: int
    n_tokens: int
    n_bytes: int


def _check(stream: TokenStream, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise InvalidValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if len(stream) < seq_len + 1:
        raise CorpusError(
            f"{stream.name}: text is {len(stream)} tokens long, too short for a context of "
            f"seq_len={seq_len} (needs at least {seq_len + 1} tokens)"
        )


def _windows(stream: TokenStream, starts: Tensor, seq_len: int) -> Batch:
    idx = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)
    window = stream.ids[idx]
    targets = window[:, 1:]
    return Batch(
        input_ids=window[:, :-1],
        targets=targets,
        domains=stream.domains[idx[:, 1:]].to(torch.int64),
        target_bytes=stream.token_bytes[targets],
        doc_ids=None if stream.doc_index is None else stream.doc_index[idx[:, :-1]],
    )


def sample_batch(
    stream: TokenStream, batch_size: int, seq_len: int, generator: torch.Generator
) -> Batch:
    """``batch_size`` windows at uniformly random offsets, deterministic given ``generator``.

    Args:
        stream: the training stream.
        batch_size: B.
        seq_len: S, the context length.
        generator: a CPU ``torch.Generator``; its state advances.

    Returns:
        A :class:`Batch` of ``[B, S]`` tensors on CPU.

    Raises:
        CorpusError: the stream has fewer than ``seq_len + 1`` tokens (message gives both).
        ValueError: ``batch_size`` or ``seq_len`` below 1.
    """
    _check(stream, batch_size, seq_len)
    high = len(stream) - seq_len  # last valid start is N - S - 1
    starts = torch.randint(0, high, (batch_size,), generator=generator, dtype=torch.int64)
    return _windows(stream, starts, seq_len)


def eval_coverage(stream: TokenStream, seq_len: int, max_tokens: int | None = None) -> EvalCoverage:
    """Windows, target tokens and bytes that ``eval_batches(stream, _, seq_len, max_tokens)``
    covers.

    Raises:
        CorpusError: the stream has fewer than ``seq_len + 1`` tokens.
        ValueError: ``seq_len < 1`` or ``max_tokens < seq_len``.
    """
    _check(stream, 1, seq_len)
    n_windows = (len(stream) - 1) // seq_len
    if max_tokens is not None:
        if max_tokens < seq_len:
            raise InvalidValueError(f"max_tokens={max_tokens} is below seq_len={seq_len}")
        n_windows = min(n_windows, max_tokens // seq_len)
    n_tokens = n_windows * seq_len
    n_bytes = int(stream.token_bytes[stream.ids[1 : n_tokens + 1]].sum())
    return EvalCoverage(n_windows=n_windows, n_tokens=n_tokens, n_bytes=n_bytes)


def eval_batches(
    stream: TokenStream, batch_size: int, seq_len: int, max_tokens: int | None = None
) -> Iterator[Batch]:
    """Consecutive windows starting at ``0, S, 2S, ...`` so the targets are disjoint and cover
    tokens ``1 .. n_windows * S`` of the stream; a partial last window is dropped.

    ``max_tokens`` caps the target tokens (rounded down to whole windows). The last batch may
    have fewer than ``batch_size`` rows. Deterministic: no randomness involved.

    Raises:
        CorpusError: the stream has fewer than ``seq_len + 1`` tokens.
        ValueError: ``batch_size``/``seq_len`` below 1 or ``max_tokens < seq_len``.
    """
    _check(stream, batch_size, seq_len)
    n_windows = eval_coverage(stream, seq_len, max_tokens).n_windows

    def generate() -> Iterator[Batch]:
        for first in range(0, n_windows, batch_size):
            count = min(batch_size, n_windows - first)
            starts = (torch.arange(count, dtype=torch.int64) + first) * seq_len
            yield _windows(stream, starts, seq_len)

    return generate()
