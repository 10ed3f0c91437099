"""Texts → padded token ids and attention mask for a BERT-style encoder.

A thin wrapper over a Hugging Face ``tokenizers.Tokenizer`` (e.g. a WordPiece
``tokenizer.json``): its post-processor adds the special tokens ([CLS] ... [SEP] for BERT),
each text is truncated to ``max_length`` tokens (special tokens included), and a batch is padded
on the right to its longest text, as sentence-transformers does. Whatever padding or
truncation the file itself sets (all-MiniLM-L6-v2's pads every text to 128) is replaced.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from moelab.data.errors import TokenizerError
from moelab.errors import InvalidTypeError, InvalidValueError

PAD_TOKEN = "[PAD]"
"""Padding token looked up when the tokenizer file sets no padding (BERT's)."""


class EncoderTokenizer:
    """Batches of texts → ``(input_ids [N, S] int64, attention_mask [N, S] bool)``.

    Attributes:
        max_length: most tokens per text, special tokens included (longer texts are cut).
        pad_id: id written at padding positions.
    """

    def __init__(self, hf_tokenizer, *, max_length: int) -> None:
        """Wrap a copy of ``hf_tokenizer`` (the caller's object is not reconfigured).

        Raises:
            InvalidValueError: ``max_length < 2`` (no room for [CLS] and [SEP]).
            TokenizerError: no padding id set and no ``[PAD]`` token in the vocabulary.
        """
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise InvalidValueError(f"max_length: must be an int >= 2, got {max_length!r}")
        tok = HFTokenizer.from_str(hf_tokenizer.to_str())
        padding = tok.padding
        pad_id = padding["pad_id"] if padding else tok.token_to_id(PAD_TOKEN)
        if pad_id is None:
            raise TokenizerError(f"tokenizer: sets no padding and has no {PAD_TOKEN} token")
        pad_token = padding["pad_token"] if padding else PAD_TOKEN
        tok.enable_truncation(max_length=max_length)
        tok.enable_padding(pad_id=pad_id, pad_token=pad_token)  # to the longest in the batch
        self._tok = tok
        self.max_length = max_length
        self.pad_id = int(pad_id)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, max_length: int) -> EncoderTokenizer:
        """Load a Hugging Face ``tokenizer.json``.

        Raises:
            TokenizerError: the file is missing, truncated or corrupt (the message names it).
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            hf = HFTokenizer.from_str(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenizerError(f"{path}: not found") from None
        except Exception as exc:  # tokenizers raises plain Exception on parse errors
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"{path}: corrupt or truncated tokenizer ({first_line})") from None
        return cls(hf, max_length=max_length)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Tokenize, truncate and pad ``texts``.

        Returns:
            ``input_ids [N, S]`` int64 (``pad_id`` after each text) and ``attention_mask
            [N, S]`` bool (true at real tokens), S the longest text's length (0 when N = 0).
        Raises:
            InvalidTypeError: ``texts`` is a string or holds a non-string.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InvalidTypeError("texts: expected a list of strings")
        if not texts:
            empty = torch.zeros(0, 0, dtype=torch.int64)
            return empty, empty.bool()
        enc = self._tok.encode_batch(list(texts), add_special_tokens=True)
        ids = torch.tensor([e.ids for e in enc], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.bool)
        return ids, mask
