"""EncoderTokenizer on a tiny hand-made WordPiece tokenizer: special tokens, truncation,
right padding to the longest text, and errors naming the file."""

from __future__ import annotations

import pytest
import torch

from moelab.data import EncoderTokenizer, TokenizerError
from moelab.errors import InvalidTypeError, InvalidValueError

tokenizers = pytest.importorskip("tokenizers")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "big", "##gest", "cat"]


def wordpiece(pad: str | None = "[PAD]"):
    vocab = {t: i for i, t in enumerate(VOCAB) if t != "[PAD]" or pad}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


def test_ids_mask_truncation_and_padding():
    hf = wordpiece()
    hf.enable_padding(length=10)  # a fixed padding in the file is replaced
    tok = EncoderTokenizer(hf, max_length=5)
    assert hf.padding["length"] == 10  # the caller's tokenizer is left as it was
    ids, mask = tok(["Hello world", "biggest cat hello world cat", "dog"])
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool
    assert ids.tolist() == [[2, 4, 5, 3, 0], [2, 6, 7, 8, 3], [2, 1, 3, 0, 0]]
    assert mask.sum(1).tolist() == [4, 5, 3] and (ids[~mask] == tok.pad_id).all()
    assert tok.vocab_size == 9 and tok.max_length == 5
    empty_ids, empty_mask = tok([])
    assert empty_ids.shape == (0, 0) and empty_mask.dtype == torch.bool


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"sets no padding and has no \[PAD\] token"):
        EncoderTokenizer(wordpiece(pad=None), max_length=8)
    with pytest.raises(InvalidValueError, match="max_length: must be an int >= 2, got 1"):
        EncoderTokenizer(wordpiece(), max_length=1)
    with pytest.raises(InvalidTypeError, match="texts: expected a list of strings"):
        EncoderTokenizer(wordpiece(), max_length=8)("hello")
    path = tmp_path / "tokenizer.json"
    with pytest.raises(TokenizerError, match=f"{path}: not found"):
        EncoderTokenizer.from_file(path, max_length=8)
    path.write_text(wordpiece().to_str()[:-20])
    with pytest.raises(TokenizerError, match="corrupt or truncated tokenizer") as info:
        EncoderTokenizer.from_file(path, max_length=8)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    path.write_text(wordpiece().to_str())
    assert EncoderTokenizer.from_file(path, max_length=8)(["cat"])[0].tolist() == [[2, 8, 3]]
