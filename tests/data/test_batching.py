"""TokenStream, sample_batch and eval_batches: shapes, shifts, determinism, coverage, bytes."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.data import (
    BPETokenizer,
    ByteTokenizer,
    CorpusError,
    Document,
    TokenStream,
    eval_batches,
    eval_coverage,
    load_corpus,
    sample_batch,
)

DOCS = [
    Document("a", "code", "def f():\n    return 1\n"),
    Document("b", "kjv", "1:1 In the beginning God created the heaven and the earth."),
    Document("c", "code", "x = 'é日'\n"),
]
NAMES = ("code", "kjv", "shakespeare")


@pytest.fixture(scope="module")
def hamlet() -> Document:
    return next(d for d in load_corpus("shakespeare") if d.name == "hamlet")


def test_byte_stream_concatenates_with_newlines() -> None:
    stream = TokenStream.from_documents(DOCS, ByteTokenizer(), domain_names=NAMES, name="val")
    text = "".join(d.text + "\n" for d in DOCS)
    assert stream.ids.dtype == torch.int64
    assert stream.ids.tolist() == list(text.encode("utf-8"))
    assert stream.n_bytes == len(text.encode("utf-8")) == len(stream)
    assert stream.bytes_per_token == 1.0
    sizes = [d.n_bytes + 1 for d in DOCS]
    expected = [0] * sizes[0] + [1] * sizes[1] + [0] * sizes[2]
    assert stream.domains.dtype == torch.uint8
    assert stream.domains.tolist() == expected
    assert stream.domain_names == NAMES


def test_default_domain_names_are_sorted_and_unknown_domain_raises() -> None:
    stream = TokenStream.from_documents(DOCS[::-1], ByteTokenizer())
    assert stream.domain_names == ("code", "kjv")
    with pytest.raises(ValueError, match="kjv"):
        TokenStream.from_documents(DOCS, ByteTokenizer(), domain_names=["code"])
    with pytest.raises(CorpusError, match="train: no documents"):
        TokenStream.from_documents([], ByteTokenizer(), name="train")


def test_bpe_stream_uses_eot_and_counts_bytes(hamlet: Document) -> None:
    tok = BPETokenizer.train([hamlet.text], vocab_size=400)
    stream = TokenStream.from_documents(DOCS, tok, domain_names=NAMES)
    assert (stream.ids == tok.eot_id).sum().item() == len(DOCS)
    assert stream.n_bytes == sum(d.n_bytes for d in DOCS)
    assert int(stream.token_bytes[stream.ids].sum()) == stream.n_bytes
    assert stream.bytes_per_token > 1.3  # 92 bytes in 62 tokens
    parts = tok.decode(stream.ids.tolist()).split("<|endoftext|>")
    assert parts == [d.text for d in DOCS] + [""]


def test_sample_batch_shapes_shift_and_determinism(hamlet: Document) -> None:
    stream = TokenStream.from_documents([hamlet, *DOCS], ByteTokenizer(), domain_names=NAMES)
    g = torch.Generator().manual_seed(123)
    batch = sample_batch(stream, 8, 32, g)
    for t in (batch.input_ids, batch.targets, batch.domains, batch.target_bytes):
        assert t.shape == (8, 32) and t.dtype == torch.int64
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    # Each row is a real window of the stream, targets being the next tokens.
    ids = stream.ids.tolist()
    for row_in, row_t in zip(batch.input_ids.tolist(), batch.targets.tolist(), strict=True):
        starts = [i for i in range(len(ids) - 32) if ids[i : i + 32] == row_in]
        assert any(ids[s + 1 : s + 33] == row_t for s in starts)
    again = sample_batch(stream, 8, 32, torch.Generator().manual_seed(123))
    assert torch.equal(again.input_ids, batch.input_ids)
    other = sample_batch(stream, 8, 32, torch.Generator().manual_seed(124))
    assert not torch.equal(other.input_ids, batch.input_ids)
    # Next draw from the same generator differs (state advanced).
    assert not torch.equal(sample_batch(stream, 8, 32, g).input_ids, batch.input_ids)


def test_sample_batch_reaches_the_last_token() -> None:
    stream = TokenStream.from_documents([Document("d", "code", "abcdefg")], ByteTokenizer())
    g = torch.Generator().manual_seed(0)
    batch = sample_batch(stream, 200, 7, g)  # stream is "abcdefg\n": exactly 1 window
    assert batch.input_ids.tolist() == [list(b"abcdefg")] * 200
    assert batch.targets.tolist() == [list(b"bcdefg\n")] * 200


def test_domains_follow_target_tokens() -> None:
    stream = TokenStream.from_documents(DOCS, ByteTokenizer(), domain_names=NAMES)
    [batch] = list(eval_batches(stream, 1000, len(stream) - 1))
    assert batch.domains[0].tolist() == stream.domains[1:].tolist()


def test_eval_batches_disjoint_covering_deterministic(hamlet: Document) -> None:
    stream = TokenStream.from_documents([hamlet], ByteTokenizer())
    seq_len, batch_size = 64, 7
    batches = list(eval_batches(stream, batch_size, seq_len))
    n_windows = (len(stream) - 1) // seq_len
    assert sum(b.input_ids.shape[0] for b in batches) == n_windows
    assert all(b.input_ids.shape[0] == batch_size for b in batches[:-1])
    targets = torch.cat([b.targets.reshape(-1) for b in batches])
    # Targets are tokens 1 .. n_windows*seq_len of the stream, each exactly once, in order.
    assert torch.equal(targets, stream.ids[1 : n_windows * seq_len + 1])
    inputs = torch.cat([b.input_ids.reshape(-1) for b in batches])
    assert torch.equal(inputs, stream.ids[: n_windows * seq_len])
    again = list(eval_batches(stream, batch_size, seq_len))
    assert all(torch.equal(a.targets, b.targets) for a, b in zip(batches, again, strict=True))
    coverage = eval_coverage(stream, seq_len)
    assert coverage.n_windows == n_windows
    assert coverage.n_tokens == targets.numel()
    assert coverage.n_bytes == coverage.n_tokens  # bytes tokenizer


def test_eval_batches_max_tokens_and_bpe_bytes(hamlet: Document) -> None:
    tok = BPETokenizer.train([hamlet.text], vocab_size=500)
    stream = TokenStream.from_documents([hamlet], tok)
    batches = list(eval_batches(stream, 4, 50, max_tokens=1000))
    assert sum(b.targets.numel() for b in batches) == 1000
    coverage = eval_coverage(stream, 50, max_tokens=1020)
    assert (coverage.n_windows, coverage.n_tokens) == (20, 1000)
    covered_bytes = sum(int(b.target_bytes.sum()) for b in batches)
    assert coverage.n_bytes == covered_bytes
    decoded = tok.decode(torch.cat([b.targets.reshape(-1) for b in batches]).tolist())
    assert covered_bytes == len(decoded.encode("utf-8"))
    # bits per byte from per-token nats: a uniform model over the vocab.
    nats = math.log(tok.vocab_size)
    bpb = nats / math.log(2) * coverage.n_tokens / coverage.n_bytes
    assert 1.0 < bpb < 9 / stream.bytes_per_token + 1
    with pytest.raises(ValueError, match="max_tokens"):
        list(eval_batches(stream, 4, 50, max_tokens=49))


def test_too_short_stream_raises_with_lengths() -> None:
    stream = TokenStream.from_documents(
        [Document("short", "user", "hello")], ByteTokenizer(), name="val"
    )
    assert len(stream) == 6
    for call in (
        lambda: sample_batch(stream, 2, 6, torch.Generator()),
        lambda: eval_batches(stream, 2, 6),
        lambda: eval_coverage(stream, 6),
    ):
        with pytest.raises(CorpusError, match=r"val: text is 6 tokens long.*seq_len=6"):
            call()
    assert sample_batch(stream, 2, 5, torch.Generator()).input_ids.shape == (2, 5)
    with pytest.raises(ValueError, match="batch_size"):
        sample_batch(stream, 0, 5, torch.Generator())


def test_batch_to_device() -> None:
    stream = TokenStream.from_documents(DOCS, ByteTokenizer())
    batch = sample_batch(stream, 2, 4, torch.Generator().manual_seed(0))
    moved = batch.to("cpu")
    assert torch.equal(moved.targets, batch.targets)
    assert moved.domains.device.type == "cpu"
