"""Read a GGUF file (llama.cpp's format) into a moelab model and tokenizer.

Every tensor is dequantised to float32 with the ``gguf`` package (``gguf.GGUFReader`` and
``gguf.quants.dequantize``; ``pip install gguf``): every type moelab's export writes (F32, F16,
BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, Q4_K) and most of llama.cpp's others. The architectures
read are the ones :mod:`moelab.interop.gguf_export` writes and llama.cpp runs: ``llama``
(dense, or with experts as Mixtral), ``qwen2moe``, ``qwen3moe`` and ``olmoe``; their tensor
layout and maths are in :mod:`moelab.interop.gguf_layout` (which also holds
:func:`permute_rope_rows`: llama.cpp's ``llama`` architecture stores Q/K rows permuted for its
interleaved-pair RoPE, undone here).

The vocabulary in the metadata becomes a moelab tokenizer: byte-level BPE
(``tokenizer.ggml.model == "gpt2"``) a :class:`moelab.data.tokenizer.BPETokenizer`, the
256-byte ``rwkv`` vocabulary moelab writes for its byte tokenizer a
:class:`moelab.data.tokenizer.ByteTokenizer` (:mod:`moelab.interop.gguf_vocab`).
Anything else raises ``ValueError`` naming the key and the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.errors import InvalidValueError, MissingDependencyError
from moelab.interop.gguf_layout import (
    GGUF_ARCHS,
    GGUFArch,
    from_gguf,
    gguf_rules,
)
from moelab.interop.gguf_vocab import byte_vocab_tokens, unescape_rwkv
from moelab.models.config import ModelConfig
from moelab.models.transformer import MoETransformer

GGUF_INSTALL_HINT = "pip install gguf"

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) whose regexes split every digit
# on its own before the GPT-2 pattern (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM,
# CODESHELL, EXAONE, MINERVA); those that use the plain GPT-2 pattern (GPT2, MPT, OLMO, JAIS;
# "gpt2" is accepted as a spelling of "gpt-2").
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_PLAIN = {"gpt2", "gpt-2", "mpt", "olmo", "jais"}
# LLAMA_VOCAB_PRE_TYPE_DEFAULT (a missing key means "default" too): not the GPT-2 pattern but
# four regexes applied in turn, each splitting every piece into its matches and the text
# between them (llama-vocab.cpp, ``llm_tokenizer_bpe``'s default case).
_PRE_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without gguf
        raise MissingDependencyError(
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
    reader = _reader(path)
    metadata = _metadata(reader)
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.ascontiguousarray(arr, dtype=np.float32)
        types[t.name] = t.tensor_type.name
    return GGUFCheckpoint(path=path, metadata=metadata, tensors=tensors, tensor_types=types)


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata fields of a GGUF file (no tensor is dequantised).

    Raises:
        ImportError: no ``gguf`` package. ValueError: a missing or unreadable file.
    """
    return _metadata(_reader(Path(path)))


def _reader(path: Path) -> Any:
    gguf = _import_gguf()
    if not path.is_file():
        raise InvalidValueError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error/... on bad files
        raise InvalidValueError(f"{path}: not a readable GGUF file ({e})") from e


def _metadata(reader: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        try:
            metadata[key] = fld.contents()
        except Exception:  # exotic field types we do not need
            continue
    return metadata


# ------------------------------------------------------------------------- model
def _arch(ckpt: GGUFCheckpoint) -> GGUFArch:
    arch = ckpt.meta("general.architecture")
    if arch not in GGUF_ARCHS:
        raise InvalidValueError(
            f"{ckpt.path}: general.architecture is {arch!r}; supported: {sorted(GGUF_ARCHS)}"
        )
    return GGUF_ARCHS[arch]


def _int_meta(ckpt: GGUFCheckpoint, key: str, default: Any = ...) -> int:
    v = ckpt.meta(key, default)
    if isinstance(v, list):
        raise InvalidValueError(
            f"{ckpt.path}: {key} is per layer ({v[:4]}...); moelab models use one value"
        )
    return int(v)


def _tensor(ckpt: GGUFCheckpoint, name: str) -> np.ndarray:
    if name not in ckpt.tensors:
        raise InvalidValueError(f"{ckpt.path}: tensor {name!r} is missing")
    return ckpt.tensors[name]


def config_from_gguf(ckpt: GGUFCheckpoint, max_seq_len: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file of one of llama.cpp's architectures that moelab
    computes (:mod:`moelab.interop.gguf_layout`: ``llama`` dense or with experts, ``qwen2moe``,
    ``qwen3moe``, ``olmoe``).

    Routers are softmax-then-top-k with the architecture's fixed renormalisation; expert
    widths come from the expert tensors' shapes; the head is tied when ``output.weight`` is
    absent or equal to ``token_embd.weight``.

    Args:
        max_seq_len: positions the model supports; ``None`` = ``{arch}.context_length``.
    Raises:
        ValueError: another architecture, missing metadata, or an unsupported variant
            (partial or scaled RoPE, per-layer head or expert counts), naming the key.
    """
    spec = _arch(ckpt)
    p = spec.name + "."
    d_model = _int_meta(ckpt, p + "embedding_length")
    n_heads = _int_meta(ckpt, p + "attention.head_count")
    n_kv = _int_meta(ckpt, p + "attention.head_count_kv", n_heads)
    head_dim = _int_meta(ckpt, p + "attention.key_length", d_model // n_heads)
    if _int_meta(ckpt, p + "attention.value_length", head_dim) != head_dim:
        raise InvalidValueError(
            f"{ckpt.path}: {p}attention.value_length differs from key_length={head_dim}"
        )
    rope_dim = _int_meta(ckpt, p + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise InvalidValueError(
            f"{ckpt.path}: {p}rope.dimension_count={rope_dim} differs from head_dim={head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    if ckpt.meta(p + "rope.scaling.type", "none") not in ("none", None):
        raise InvalidValueError(f"{ckpt.path}: {p}rope.scaling.type: RoPE scaling is not supported")
    emb = _tensor(ckpt, "token_embd.weight")
    out = ckpt.tensors.get("output.weight")
    tied = out is None or (out.shape == emb.shape and np.array_equal(out, emb))
    n_experts = _int_meta(ckpt, p + "expert_count", 0)
    ffn = ckpt.meta(p + "feed_forward_length", None)
    moe = None
    if n_experts:
        gate = _tensor(ckpt, "blk.0.ffn_gate_exps.weight")  # [E, F, D]
        shared = ckpt.tensors.get("blk.0.ffn_gate_shexp.weight")  # [Fs, D]
        shared_size = int(shared.shape[0]) if spec.shared_expert and shared is not None else 0
        moe = MoEConfig(
            router=RouterConfig(
                num_experts=n_experts,
                top_k=_int_meta(ckpt, p + "expert_used_count"),
                score_func="softmax",
                softmax_before_topk=True,
                norm_topk_prob=spec.norm_topk_prob,
            ),
            experts=ExpertsConfig(
                hidden_size=d_model,
                ffn_hidden_size=int(gate.shape[1]),
                shared_expert_size=shared_size,
                shared_expert_gate=shared_size > 0,
            ),
        )
    elif spec.name != "llama":
        raise InvalidValueError(f"{ckpt.path}: {p}expert_count is missing; {spec.name} is MoE")
    ctx = _int_meta(ckpt, p + "context_length")
    return ModelConfig(
        vocab_size=int(emb.shape[0]),
        d_model=d_model,
        n_layers=_int_meta(ckpt, p + "block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        max_seq_len=ctx if max_seq_len is None else max_seq_len,
        rope_theta=float(ckpt.meta(p + "rope.freq_base", 10000.0)),
        norm_eps=float(ckpt.meta(p + "attention.layer_norm_rms_epsilon")),
        tie_embeddings=tied,
        attention_bias="blk.0.attn_q.bias" in ckpt.tensors,
        qk_norm={"qwen3moe": "head", "olmoe": "full"}.get(spec.name, "none"),
        dense_ffn_size=None if ffn is None or isinstance(ffn, list) else int(ffn),
        moe=moe,
    )


def state_dict_from_gguf(ckpt: GGUFCheckpoint, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """moelab state dict (float32) of a GGUF checkpoint (:func:`gguf_rules`, inverted: Q/K
    rows un-permuted for ``llama``, expert halves joined and transposed).

    Raises:
        ValueError: a tensor is missing or unexpected (names it).
    """
    spec = _arch(ckpt)
    sd: dict[str, torch.Tensor] = {}
    used = {"rope_freqs.weight"}
    for rule in gguf_rules(cfg, spec):
        if rule.target == "lm_head.weight" and cfg.tie_embeddings:
            used.update(rule.sources)
            continue
        ts = [torch.from_numpy(_tensor(ckpt, n).copy()) for n in rule.sources]
        sd[rule.target] = from_gguf(rule, ts)
        used.update(rule.sources)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    extra = sorted(set(ckpt.tensors) - used)
    if extra:
        raise InvalidValueError(
            f"{ckpt.path}: unsupported tensor(s) {extra[:5]}{'...' if len(extra) > 5 else ''} "
            f"(not part of a moelab {spec.name} model)"
        )
    return sd


def load_gguf_model(
    path_or_ckpt: str | os.PathLike[str] | GGUFCheckpoint,
    *,
    max_seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> MoETransformer:
    """A :class:`MoETransformer` holding the weights of a GGUF file (see
    :func:`config_from_gguf` for the architectures read).

    Args:
        path_or_ckpt: the ``.gguf`` file or an already read :class:`GGUFCheckpoint`.
        max_seq_len: ``None`` = the file's ``{arch}.context_length``.
        dtype: parameter dtype (weights are dequantised to float32 first).
    Raises:
        MissingDependencyError: ``gguf`` is not installed. ValueError: unsupported or
            broken file.
    """
    ckpt = path_or_ckpt if isinstance(path_or_ckpt, GGUFCheckpoint) else read_gguf(path_or_ckpt)
    cfg = config_from_gguf(ckpt, max_seq_len)
    sd = state_dict_from_gguf(ckpt, cfg)
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
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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
    elif pre == "default":
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_DEFAULT]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        raise InvalidValueError(
            f"{ckpt.path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(known: {sorted(_PRE_DIGITS | _PRE_PLAIN | {'default'})})"
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
    """The GGUF vocabulary as a moelab tokenizer (saves with ``tokenizer.save(folder)``, loads
    with ``load_tokenizer``): a :class:`~moelab.data.tokenizer.ByteTokenizer` for the 256-byte
    ``rwkv`` vocabulary, else a :class:`~moelab.data.tokenizer.BPETokenizer`.

    Raises:
        ValueError: see :func:`build_gguf_tokenizer`; an ``rwkv`` vocabulary other than the
            256 single bytes in byte order.
    """
    from moelab.data.tokenizer import BPETokenizer, ByteTokenizer

    ckpt = path_or_ckpt if isinstance(path_or_ckpt, GGUFCheckpoint) else read_gguf(path_or_ckpt)
    if ckpt.meta("tokenizer.ggml.model", None) == "rwkv":
        tokens = [str(t) for t in ckpt.meta("tokenizer.ggml.tokens")]
        if [unescape_rwkv(t) for t in tokens] != [bytes([b]) for b in range(256)]:
            raise InvalidValueError(
                f"{ckpt.path}: tokenizer.ggml.model 'rwkv' is read only as the 256 single bytes "
                f"in byte order ({byte_vocab_tokens()[:2]}...), got {len(tokens)} tokens"
            )
        return ByteTokenizer()
    return BPETokenizer(build_gguf_tokenizer(ckpt))


def load_gguf(
    path: str | os.PathLike[str], *, max_seq_len: int | None = None
) -> tuple[MoETransformer, Any]:
    """``(model, tokenizer)`` of a GGUF file (read once)."""
    ckpt = read_gguf(path)
    return load_gguf_model(ckpt, max_seq_len=max_seq_len), load_gguf_tokenizer(ckpt)
