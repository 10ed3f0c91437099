"""Read a llama-architecture GGUF file (llama.cpp's format) into a dense moelab model.

Every tensor is dequantised to float32 with the ``gguf`` package (``gguf.GGUFReader`` and
``gguf.quants.dequantize``; ``pip install gguf``), the llama tensor names are mapped onto a
dense :class:`moelab.models.MoETransformer` (``ModelConfig(moe=None)``), and the byte-level BPE
vocabulary stored in the file's metadata becomes a :class:`moelab.data.tokenizer.BPETokenizer`.

Tensor mapping (GGUF name → moelab name; GGUF stores each matrix as ``[out, in]`` once
dequantised, i.e. the ``nn.Linear`` layout)::

    token_embd.weight           embed.weight  (and the LM head when there is no output.weight)
    output.weight               lm_head.weight (absent = tied embeddings)
    output_norm.weight          norm.weight
    blk.N.attn_norm.weight      blocks.N.attn_norm.weight
    blk.N.attn_q.weight         blocks.N.attn.q_proj.weight  (RoPE row permutation undone)
    blk.N.attn_k.weight         blocks.N.attn.k_proj.weight  (RoPE row permutation undone)
    blk.N.attn_v.weight         blocks.N.attn.v_proj.weight
    blk.N.attn_output.weight    blocks.N.attn.o_proj.weight
    blk.N.ffn_norm.weight       blocks.N.ffn_norm.weight
    blk.N.ffn_gate/up/down.weight  blocks.N.ffn.w_gate/w_up/w_down.weight

RoPE layout: llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of every head of the Q and
K projections (``LlamaModel.permute``: ``w.reshape(H, 2, hd/2, D).swapaxes(1, 2)``) so that its
interleaved-pair ("normal") RoPE, which rotates adjacent pairs ``(x[2i], x[2i+1])``, computes
what Hugging Face's rotate-half RoPE computes on the original rows (pairs ``(x[i],
x[i+hd/2])``). moelab uses rotate-half (:mod:`moelab.models.rope`), so :func:`unpermute_rope_rows`
applies the inverse permutation ``w.reshape(H, hd/2, 2, D).swapaxes(1, 2)``.

Only what a llama-architecture file needs is supported: ``general.architecture == "llama"``,
no attention/FFN biases, GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``).
Anything else raises ``ValueError`` naming the key and the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.errors import InvalidValueError
from moelab.models.config import ModelConfig
from moelab.models.transformer import MoETransformer

GGUF_INSTALL_HINT = "pip install gguf"

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) whose regexes split every digit
# on its own before the GPT-2 pattern (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM,
# CODESHELL, EXAONE, MINERVA); "default"/"gpt2" use the plain GPT-2 pattern.
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_PLAIN = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without gguf
        raise ImportError(
            f"reading GGUF files needs the 'gguf' package: {GGUF_INSTALL_HINT}"
        ) from e
    return gguf


@dataclass
class GGUFCheckpoint:
    """The contents of a GGUF file, every tensor dequantised to float32.

    Attributes:
        path: the file read.
        metadata: key → value (strings, numbers, lists) of every metadata field.
        tensors: GGUF tensor name → float32 numpy array in GGUF's row-major order
            (``[out, in]`` for matrices, the ``nn.Linear`` layout).
        tensor_types: GGUF tensor name → quantisation type name (e.g. ``"Q4_1"``, ``"F32"``).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(repr=False)
    tensor_types: dict[str, str] = field(default_factory=dict, repr=False)

    def meta(self, key: str, default: Any = ...) -> Any:
        """Metadata value of ``key``; raises ``ValueError`` naming the file when absent."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise InvalidValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return default


def read_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read ``path`` with ``gguf.GGUFReader`` and dequantise every tensor to float32.

    Raises:
        ImportError: the ``gguf`` package is not installed (message: ``pip install gguf``).
        ValueError: the file is missing or is not a readable GGUF file (message names it).
    """
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise InvalidValueError(f"{path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error/... on bad files
        raise InvalidValueError(f"{path}: not a readable GGUF file ({e})") from e
    metadata: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        try:
            metadata[key] = fld.contents()
        except Exception:  # exotic field types we do not need
            continue
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.ascontiguousarray(arr, dtype=np.float32)
        types[t.name] = t.tensor_type.name
    return GGUFCheckpoint(path=path, metadata=metadata, tensors=tensors, tensor_types=types)


# ----------------------------------------------------------------------- RoPE rows
def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    Within each head, rows ``[x_0..x_{hd/2-1}, y_0..y_{hd/2-1}]`` (rotate-half pairs
    ``(x_i, y_i)``) become ``[x_0, y_0, x_1, y_1, ...]`` (interleaved pairs).

    Args:
        w: ``[n_heads·hd, D]`` projection weight (``nn.Linear`` layout).
        n_heads: heads of this projection (query heads for Q, key/value heads for K).
    """
    out_dim = w.shape[0]
    if out_dim % (2 * n_heads):
        raise InvalidValueError(
            f"n_heads: {n_heads} heads with even head_dim must divide {out_dim} rows"
        )
    hd = out_dim // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_rope_rows`: interleaved-pair rows back to rotate-half rows."""
    out_dim = w.shape[0]
    if out_dim % (2 * n_heads):
        raise InvalidValueError(
            f"n_heads: {n_heads} heads with even head_dim must divide {out_dim} rows"
        )
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------- model
def llama_config_from_gguf(ckpt: GGUFCheckpoint, max_seq_len: int | None = None) -> ModelConfig:
    """The dense :class:`ModelConfig` (``moe=None``) of a llama-architecture GGUF file.

    Args:
        max_seq_len: positions the model supports; ``None`` = ``llama.context_length``.
    Raises:
        ValueError: not a llama file, missing metadata, or an unsupported variant.
    """
    arch = ckpt.meta("general.architecture")
    if arch != "llama":
        raise InvalidValueError(
            f"{ckpt.path}: general.architecture is {arch!r}; only 'llama' files are supported"
        )
    p = "llama."
    d_model = int(ckpt.meta(p + "embedding_length"))
    n_heads = int(ckpt.meta(p + "attention.head_count"))
    n_kv = int(ckpt.meta(p + "attention.head_count_kv", n_heads))
    head_dim = d_model // n_heads
    rope_dim = int(ckpt.meta(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise InvalidValueError(
            f"{ckpt.path}: llama.rope.dimension_count={rope_dim} differs from head_dim={head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    if ckpt.meta(p + "rope.scaling.type", "none") not in ("none", None):
        raise InvalidValueError(f"{ckpt.path}: RoPE scaling is not supported")
    emb = ckpt.tensors.get("token_embd.weight")
    if emb is None:
        raise InvalidValueError(f"{ckpt.path}: tensor 'token_embd.weight' is missing")
    vocab = int(ckpt.meta(p + "vocab_size", emb.shape[0]))
    ctx = int(ckpt.meta(p + "context_length"))
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=int(ckpt.meta(p + "block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        max_seq_len=ctx if max_seq_len is None else max_seq_len,
        rope_theta=float(ckpt.meta(p + "rope.freq_base", 10000.0)),
        norm_eps=float(ckpt.meta(p + "attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in ckpt.tensors,
        dense_ffn_size=int(ckpt.meta(p + "feed_forward_length")),
        moe=None,
    )


def llama_state_dict_from_gguf(ckpt: GGUFCheckpoint, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """moelab state dict (float32) of a llama GGUF checkpoint, Q/K rows un-permuted.

    Raises:
        ValueError: a tensor is missing, unexpected, or has the wrong shape (names it).
    """
    t = ckpt.tensors

    def get(name: str) -> torch.Tensor:
        if name not in t:
            raise InvalidValueError(f"{ckpt.path}: tensor {name!r} is missing")
        return torch.from_numpy(t[name].copy())

    sd: dict[str, torch.Tensor] = {
        "embed.weight": get("token_embd.weight"),
        "norm.weight": get("output_norm.weight"),
    }
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else get("output.weight")
    used = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(cfg.n_layers):
        b, m = f"blk.{i}.", f"blocks.{i}."
        names = {
            "attn_norm.weight": "attn_norm.weight",
            "attn_q.weight": "attn.q_proj.weight",
            "attn_k.weight": "attn.k_proj.weight",
            "attn_v.weight": "attn.v_proj.weight",
            "attn_output.weight": "attn.o_proj.weight",
            "ffn_norm.weight": "ffn_norm.weight",
            "ffn_gate.weight": "ffn.w_gate.weight",
            "ffn_up.weight": "ffn.w_up.weight",
            "ffn_down.weight": "ffn.w_down.weight",
        }
        for g_name, m_name in names.items():
            w = get(b + g_name)
            if g_name == "attn_q.weight":
                w = unpermute_rope_rows(w, cfg.n_heads)
            elif g_name == "attn_k.weight":
                w = unpermute_rope_rows(w, cfg.n_kv_heads)
            sd[m + m_name] = w
            used.add(b + g_name)
    extra = sorted(n for n in t if n not in used and not n.endswith("rope_freqs.weight"))
    if extra:
        raise InvalidValueError(
            f"{ckpt.path}: unsupported tensor(s) {extra[:5]}{'...' if len(extra) > 5 else ''} "
            "(biases or a non-llama variant?)"
        )
    return sd


def load_gguf_model(
    path_or_ckpt: str | os.PathLike[str] | GGUFCheckpoint,
    *,
    max_seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> MoETransformer:
    """A dense :class:`MoETransformer` holding the weights of a llama GGUF file.

    Args:
        path_or_ckpt: the ``.gguf`` file or an already read :class:`GGUFCheckpoint`.
        max_seq_len: ``None`` = the file's ``llama.context_length``.
        dtype: parameter dtype (weights are dequantised to float32 first).
    Raises:
        ImportError: ``gguf`` is not installed. ValueError: unsupported or broken file.
    """
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, GGUFCheckpoint) else read_gguf(path_or_ckpt)
    cfg = llama_config_from_gguf(ckpt, max_seq_len)
    sd = llama_state_dict_from_gguf(ckpt, cfg)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    expected = model.state_dict()
    for name, w in sd.items():
        if name not in expected:
            raise InvalidValueError(f"{ckpt.path}: no moelab parameter for {name!r}")
        if tuple(w.shape) != tuple(expected[name].shape):
            raise InvalidValueError(
                f"{ckpt.path}: tensor for {name!r} has shape {tuple(w.shape)}, the config "
                f"needs {tuple(expected[name].shape)}"
            )
    model.load_state_dict(sd, strict=True)
    return model.to(dtype).eval()


# --------------------------------------------------------------------- tokenizer
def build_gguf_tokenizer(ckpt: GGUFCheckpoint) -> Any:
    """A Hugging Face ``tokenizers.Tokenizer`` (byte-level BPE) from the GGUF metadata.

    Uses ``tokenizer.ggml.tokens`` (id order), ``tokenizer.ggml.merges`` (rank order),
    ``tokenizer.ggml.token_type`` (3 = control → special added token, 4 = user-defined →
    added token) and ``tokenizer.ggml.pre`` (the pre-tokenizer regex family).

    Raises:
        ValueError: not a GPT-2-style BPE vocabulary, or an unknown pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = ckpt.meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidValueError(
            f"{ckpt.path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
            "is supported"
        )
    tokens = [str(s) for s in ckpt.meta("tokenizer.ggml.tokens")]
    merges_raw = [str(s) for s in ckpt.meta("tokenizer.ggml.merges")]
    types = list(ckpt.meta("tokenizer.ggml.token_type", [1] * len(tokens)))
    pre = str(ckpt.meta("tokenizer.ggml.pre", "default"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidValueError(f"{ckpt.path}: tokenizer.ggml.tokens holds duplicate tokens")
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise InvalidValueError(f"{ckpt.path}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _PRE_PLAIN:
        tok.pre_tokenizer = byte_level
    else:
        raise InvalidValueError(
            f"{ckpt.path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(known: {sorted(_PRE_DIGITS | _PRE_PLAIN)})"
        )
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True) for i, ty in enumerate(types) if ty == 3]
    user = [AddedToken(tokens[i], special=False) for i, ty in enumerate(types) if ty == 4]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise InvalidValueError(f"{ckpt.path}: rebuilt vocabulary size differs from {len(tokens)}")
    return tok


def load_gguf_tokenizer(path_or_ckpt: str | os.PathLike[str] | GGUFCheckpoint) -> Any:
    """The GGUF vocabulary as a :class:`moelab.data.tokenizer.BPETokenizer` (saves with
    ``tokenizer.save(folder)``, loads with ``load_tokenizer``).

    Raises:
        ValueError: see :func:`build_gguf_tokenizer`; the vocabulary has no ``<|endoftext|>``
            token (moelab's BPE tokenizer needs one as its end-of-text id).
    """
    from moelab.data.tokenizer import BPETokenizer

    ckpt = path_or_ckpt if isinstance(path_or_ckpt, GGUFCheckpoint) else read_gguf(path_or_ckpt)
    return BPETokenizer(build_gguf_tokenizer(ckpt))


def load_gguf(
    path: str | os.PathLike[str], *, max_seq_len: int | None = None
) -> tuple[MoETransformer, Any]:
    """``(dense model, BPETokenizer)`` of a llama GGUF file (read once)."""
    ckpt = read_gguf(path)
    return load_gguf_model(ckpt, max_seq_len=max_seq_len), load_gguf_tokenizer(ckpt)
