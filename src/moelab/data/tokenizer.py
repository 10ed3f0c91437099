"""Tokenizers: UTF-8 bytes (default) and byte-level BPE, with atomic save and ``load_tokenizer``.

A saved tokenizer is a folder holding ``tokenizer_meta.json`` (``{"format_version": 1,
"kind": "byte" | "bpe", "vocab_size": V}``) and, for BPE, the Hugging Face ``tokenizer.json``.
The meta file is written last, so a folder with a meta file holds a complete tokenizer.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from moelab.data.errors import TokenizerError
from moelab.errors import InvalidValueError
from moelab.utils.atomic import atomic_write_text

META_FILE = "tokenizer_meta.json"
"""Name of the file recording which kind of tokenizer a folder holds."""
BPE_FILE = "tokenizer.json"
"""Name of the Hugging Face ``tokenizers`` file of a BPE tokenizer."""
FORMAT_VERSION = 1
EOT_TOKEN = "<|endoftext|>"
"""The BPE end-of-text special token (id 0)."""


class Tokenizer(ABC):
    """Text ↔ token ids. Subclasses: :class:`ByteTokenizer`, :class:`BPETokenizer`.

    Attributes:
        kind: ``"byte"`` or ``"bpe"`` (recorded in the saved meta file).
        eot_id: id appended after each document in a token stream, or ``None`` when the
            tokenizer has no end-of-text token (then a newline is appended instead).
    """

    kind: str
    eot_id: int | None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids; every id is in ``[0, vocab_size)``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ``decode(encode(t)) == t`` for every string ``t``."""

    @abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """``[vocab_size]`` int64: UTF-8 bytes each token stands for (0 for special tokens).

        Summed over the ids of ``encode(t)`` this gives ``len(t.encode("utf-8"))``, which is
        what bits-per-byte needs.
        """

    def encode_arrays(self, texts: Iterable[str]) -> list[np.ndarray]:
        """Encode many texts to int64 arrays (subclasses override with faster paths)."""
        return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write the tokenizer into ``folder`` (created if needed), atomically per file."""
        self._save_files(Path(folder))
        meta = {"format_version": FORMAT_VERSION, "kind": self.kind, "vocab_size": self.vocab_size}
        atomic_write_text(Path(folder) / META_FILE, json.dumps(meta, indent=2) + "\n")

    def _save_files(self, folder: Path) -> None:
        """Write the kind-specific files (before the meta file); none by default."""
        folder.mkdir(parents=True, exist_ok=True)


class ByteTokenizer(Tokenizer):
    """The 256 UTF-8 byte values as tokens; no special tokens (``eot_id`` is ``None``).

    ``decode`` replaces invalid UTF-8 sequences (e.g. a multi-byte character cut by a
    window edge) with U+FFFD. Ids outside ``[0, 256)`` raise ``ValueError``.
    """

    kind = "byte"
    eot_id = None

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def encode_arrays(self, texts: Iterable[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]


class BPETokenizer(Tokenizer):
    """Byte-level BPE from Hugging Face ``tokenizers`` (GPT-2 style byte alphabet).

    When trained here, id 0 is the special token ``<|endoftext|>`` (``eot_id``; None for a
    loaded ``tokenizer.json`` without it); the 256 byte symbols follow,
    then the learned merges. ``decode`` keeps special tokens, so text that literally contains
    ``<|endoftext|>`` still round-trips (it encodes to ``eot_id``, which counts 0 bytes).
    Build with :meth:`train` or :func:`load_tokenizer`.
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        # a foreign tokenizer.json may lack <|endoftext|>: documents are then joined by "\n"
        self.eot_id = hf_tokenizer.token_to_id(EOT_TOKEN)

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2
    ) -> BPETokenizer:
        """Train on ``texts`` (use the training split only). Deterministic for equal inputs.

        Args:
            texts: training texts.
            vocab_size: target vocabulary size including the 256 bytes and ``<|endoftext|>``
                (>= 257); a small corpus may yield fewer merges and so a smaller vocabulary.
            min_frequency: minimum pair count for a merge.

        Raises:
            ValueError: ``vocab_size < 257``.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise InvalidValueError(
                f"BPE vocab_size must be >= 257 (256 bytes + eot), got {vocab_size}"
            )
        texts = list(texts)
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOT_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer, length=len(texts))
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer`` (read it; changing it changes this one)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_arrays(self, texts: Iterable[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_byte_lengths(self) -> np.ndarray:
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
            # Each byte-level symbol is one character standing for one byte.
            out[idx] = 0 if token in special else len(token)
        return out

    def _save_files(self, folder: Path) -> None:
        atomic_write_text(folder / BPE_FILE, self._tok.to_str(pretty=False))


def load_tokenizer(folder: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer saved with :meth:`Tokenizer.save`, or a plain Hugging Face
    ``tokenizer.json`` (e.g. one copied along by ``moelab convert``) as a :class:`BPETokenizer`.

    Raises:
        TokenizerError: missing, truncated or corrupt ``tokenizer_meta.json`` or
            ``tokenizer.json``, unknown kind or format version, or a vocabulary size that
            differs from the recorded one. The message names the file.
    """
    folder = Path(folder)
    meta_path = folder / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not (folder / BPE_FILE).exists():
            raise TokenizerError(
                f"{meta_path}: not found; no tokenizer saved in {folder}"
            ) from None
        meta = {"kind": "bpe", "format_version": FORMAT_VERSION}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{meta_path}: corrupt or truncated tokenizer meta ({exc})") from None
    if not isinstance(meta, dict) or "kind" not in meta or "format_version" not in meta:
        raise TokenizerError(f"{meta_path}: missing 'kind' or 'format_version'")
    if meta["format_version"] != FORMAT_VERSION:
        raise TokenizerError(
            f"{meta_path}: format_version {meta['format_version']!r} unsupported "
            f"(this moelab reads {FORMAT_VERSION})"
        )
    kind = meta["kind"]
    tok: Tokenizer
    if kind == "byte":
        tok = ByteTokenizer()
        path = meta_path
    elif kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / BPE_FILE
        try:
            tok = BPETokenizer(HFTokenizer.from_str(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise TokenizerError(f"{path}: not found (required by {meta_path})") from None
        except Exception as exc:  # tokenizers raises plain Exception on parse errors
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(
                f"{path}: corrupt or truncated BPE tokenizer ({first_line})"
            ) from None
    else:
        raise TokenizerError(f"{meta_path}: unknown tokenizer kind {kind!r} (expected byte or bpe)")
    if meta.get("vocab_size", tok.vocab_size) != tok.vocab_size:
        raise TokenizerError(
            f"{path}: vocab_size {tok.vocab_size} differs from {meta['vocab_size']} in {meta_path}"
        )
    return tok


def make_tokenizer(
    kind: str, train_texts: Iterable[str] | None = None, *, vocab_size: int | None = None
) -> Tokenizer:
    """``ByteTokenizer()`` for ``kind="byte"``; ``BPETokenizer.train(train_texts, vocab_size)``
    for ``kind="bpe"``.

    Raises:
        ValueError: unknown kind, or ``bpe`` without ``train_texts`` / ``vocab_size``.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if train_texts is None or vocab_size is None:
            raise InvalidValueError("kind='bpe' needs train_texts and vocab_size")
        return BPETokenizer.train(train_texts, vocab_size)
    raise InvalidValueError(f"unknown tokenizer kind {kind!r} (expected 'byte' or 'bpe')")
