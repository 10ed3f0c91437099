"""moelab tokenizers as llama.cpp vocabularies (GGUF ``tokenizer.ggml.*`` metadata), exactly.

Read from llama.cpp's ``src/llama-vocab.cpp`` (llama-cpp-python 0.3.36):

- :class:`~moelab.data.tokenizer.BPETokenizer` (byte-level BPE of Hugging Face ``tokenizers``)
  becomes ``tokenizer.ggml.model = "gpt2"``: the tokens in id order, the merges in rank order
  as ``"a b"``, added special tokens typed CONTROL, other added tokens USER_DEFINED, the rest
  NORMAL. The pre-tokenizer must be one llama.cpp has: ``ByteLevel(use_regex=True)`` alone is
  ``tokenizer.ggml.pre = "gpt-2"`` (``LLAMA_VOCAB_PRE_TYPE_GPT2``: GPT-2's regex, the one
  ``ByteLevel`` uses), ``Digits(individual_digits=True)`` then ``ByteLevel`` is ``"smollm"``
  (``LLAMA_VOCAB_PRE_TYPE_SMOLLM``: every ``\\p{N}`` split off first, then GPT-2's regex).
  ``<|endoftext|>``, when present, is the BOS and EOS id (GPT-2's convention) and
  ``tokenizer.ggml.add_bos_token`` is false: moelab never prepends a token.
- :class:`~moelab.data.tokenizer.ByteTokenizer` becomes ``tokenizer.ggml.model = "rwkv"``:
  llama.cpp's RWKV tokenizer is a greedy longest match over a trie of byte strings
  (``llm_tokenizer_rwkv_session``); holding exactly the 256 one-byte tokens, in byte order and
  escaped as ``\\xhh`` (``llama_unescape_rwkv_token`` reads lowercase hex), it gives every byte
  its own id: moelab's byte tokenizer. A ``gpt2`` vocabulary cannot hold it: llama.cpp requires
  a merges array, the ``gguf`` writer cannot write an empty one, and a merge whose result is
  not a token makes llama.cpp drop bytes (its fallback looks up raw bytes, not byte-level
  symbols).

Both match moelab's ``encode`` when llama.cpp tokenizes with ``parse_special=True`` (moelab
always recognises its special tokens in text) and without a BOS. Anything else (a normalizer,
another pre-tokenizer or decoder, BPE dropout, ``ignore_merges``, added tokens that strip
whitespace) raises :class:`~moelab.interop.errors.UnsupportedConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from moelab.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from moelab.interop.errors import UnsupportedConfigError

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
"""``gguf.TokenType`` values (llama.cpp ``llama_token_type``)."""


@dataclass(frozen=True)
class GGUFVocab:
    """A tokenizer as GGUF metadata.

    Attributes:
        model: ``tokenizer.ggml.model`` (``"gpt2"`` or ``"rwkv"``).
        pre: ``tokenizer.ggml.pre`` (None for ``rwkv``).
        tokens: ``tokenizer.ggml.tokens`` in id order.
        token_types: ``tokenizer.ggml.token_type`` per token.
        merges: ``tokenizer.ggml.merges`` in rank order (empty for ``rwkv``).
        bos_id, eos_id: special ids (None = not written).
    """

    model: str
    pre: str | None
    tokens: list[str] = field(repr=False)
    token_types: list[int] = field(repr=False)
    merges: list[str] = field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None

    def describe(self) -> str:
        """One line: kind, pre-tokenizer and size."""
        if self.model == "rwkv":
            return f"bytes as llama.cpp 'rwkv' ({len(self.tokens)} tokens)"
        return f"byte-level BPE as llama.cpp 'gpt2', pre {self.pre!r} ({len(self.tokens)} tokens, {len(self.merges)} merges)"  # fmt: skip


def byte_vocab_tokens() -> list[str]:
    """The 256 tokens of the byte vocabulary, ``"\\x00"`` .. ``"\\xff"`` (escaped text)."""
    return [f"\\x{b:02x}" for b in range(256)]


def unescape_rwkv(token: str) -> bytes:
    """The bytes of an RWKV vocabulary entry (llama.cpp's ``llama_unescape_rwkv_token``:
    ``\\t``, ``\\n``, ``\\r``, ``\\xhh``, ``\\`` + any other character = that character)."""
    out = bytearray()
    chars = iter(token.encode("utf-8"))
    for c in chars:
        if c != ord("\\"):
            out.append(c)
            continue
        e = next(chars, None)
        if e is None:
            break
        if e == ord("x"):
            hi, lo = next(chars, ord("0")), next(chars, ord("0"))
            out.append(_hex(hi) * 16 + _hex(lo))
        else:
            out.append({ord("t"): 9, ord("n"): 10, ord("r"): 13}.get(e, e))
    return bytes(out)


def _hex(c: int) -> int:
    # llama.cpp's rule: c >= 'a' is a letter digit, anything else is c - '0'
    return (c - ord("a") + 10 if c >= ord("a") else c - ord("0")) & 0xFF


def _unsupported(what: str, msg: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"tokenizer {what}: {msg}; llama.cpp could not tokenize exactly")


def _pre_name(pre: Any) -> str:
    def byte_level(p: Any) -> bool:
        return (
            isinstance(p, dict)
            and p.get("type") == "ByteLevel"
            and p.get("use_regex", True)
            and not p.get("add_prefix_space", False)
        )

    if byte_level(pre):
        return "gpt-2"
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if (
            len(steps) == 2
            and steps[0].get("type") == "Digits"
            and steps[0].get("individual_digits")
            and byte_level(steps[1])
        ):
            return "smollm"
    raise _unsupported(
        "pre_tokenizer",
        f"{json.dumps(pre)[:120]} is neither ByteLevel(use_regex, no prefix space) nor "
        "Digits(individual) + ByteLevel",
    )


def _bpe_vocab(tok: BPETokenizer) -> GGUFVocab:
    d = json.loads(tok.hf_tokenizer.to_str())
    model = d.get("model") or {}
    if model.get("type") != "BPE":
        raise _unsupported("model", f"{model.get('type')!r} is not BPE")
    for key in (
        "dropout",
        "continuing_subword_prefix",
        "end_of_word_suffix",
        "byte_fallback",
        "ignore_merges",
    ):
        if model.get(key):
            raise _unsupported(f"model.{key}", f"is set ({model[key]!r})")
    if d.get("normalizer") is not None:
        raise _unsupported(
            "normalizer", f"{d['normalizer'].get('type')!r} (llama.cpp's gpt2 has none)"
        )
    pre = _pre_name(d.get("pre_tokenizer"))
    if (d.get("decoder") or {}).get("type") != "ByteLevel":
        raise _unsupported("decoder", f"{(d.get('decoder') or {}).get('type')!r} is not ByteLevel")
    vocab = tok.hf_tokenizer.get_vocab(with_added_tokens=True)
    n = tok.vocab_size
    by_id = {i: t for t, i in vocab.items()}
    if sorted(by_id) != list(range(n)):
        raise _unsupported("vocab", f"ids are not 0..{n - 1} without gaps")
    tokens = [by_id[i] for i in range(n)]
    types = [NORMAL] * n
    for a in d.get("added_tokens") or []:
        flags = [f for f in ("lstrip", "rstrip", "single_word") if a.get(f)]
        if flags:
            raise _unsupported(f"added token {a['content']!r}", f"{'/'.join(flags)} is set")
        types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        raise _unsupported("model.merges", "is empty (llama.cpp's gpt2 needs at least one merge)")
    eot = tok.eot_id
    return GGUFVocab("gpt2", pre, tokens, types, merges, bos_id=eot, eos_id=eot)


def gguf_vocab(
    tokenizer: Tokenizer,
    vocab_size: int,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> GGUFVocab:
    """``tokenizer`` as llama.cpp vocabulary metadata, for a model of ``vocab_size`` ids.

    Args:
        bos_token, eos_token: tokens to record as BOS/EOS instead of ``<|endoftext|>`` (e.g.
            an instruct model's ``<|im_start|>``/``<|im_end|>``); BPE only.
    Raises:
        UnsupportedConfigError: a tokenizer llama.cpp cannot reproduce exactly (names the
            part), one whose size differs from the model's ``vocab_size``, or a BOS/EOS token
            it does not hold.
    """
    if isinstance(tokenizer, ByteTokenizer):
        tokens = byte_vocab_tokens()
        v = GGUFVocab("rwkv", None, tokens, [NORMAL] * 256, [])
    elif isinstance(tokenizer, BPETokenizer):
        v = _bpe_vocab(tokenizer)
    else:
        raise UnsupportedConfigError(
            f"tokenizer: {type(tokenizer).__name__} has no llama.cpp vocabulary type"
        )
    ids = {t: i for i, t in enumerate(v.tokens)}
    for role, token in (("bos", bos_token), ("eos", eos_token)):
        if token is None:
            continue
        if v.model != "gpt2" or token not in ids:
            raise UnsupportedConfigError(
                f"{role}_token: {token!r} is not a token of the {v.model} vocabulary"
            )
        v = dataclasses.replace(v, **{f"{role}_id": ids[token]})
    if len(v.tokens) != vocab_size:
        raise UnsupportedConfigError(
            f"vocab_size: the model has {vocab_size} ids, its tokenizer {len(v.tokens)} tokens; "
            "llama.cpp needs one token per embedding row"
        )
    return v


def write_vocab(writer: Any, vocab: GGUFVocab) -> None:
    """Add ``vocab``'s metadata to a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        writer.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
