"""Write a moelab model as a GGUF file that llama.cpp (and what is built on it: Ollama, LM
Studio, llama-server) runs as the same model.

The file is written with the ``gguf`` package's ``GGUFWriter`` in one of llama.cpp's MoE
architectures (:mod:`moelab.interop.gguf_layout`: ``llama`` with experts as Mixtral,
``qwen2moe``, ``qwen3moe``, ``olmoe``; a dense model as ``llama``), with the tokenizer
(:mod:`moelab.interop.gguf_vocab`) and an optional chat template in its metadata.

Tensor types follow llama.cpp's ``convert_hf_to_gguf.py`` (``ModelBase.prepare_tensors``):
1-D tensors, norms and the routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) stay F32; every
other matrix takes the requested type: F32, F16, BF16 (round to nearest even, as ggml's
``ggml_compute_fp32_to_bf16``) or one of llama.cpp's block types along each row:

- Q8_0 (blocks of 32, one F16 scale ``d = max|w|/127``, ``round(w/d)`` as int8), Q5_1, Q5_0,
  Q4_1, Q4_0 (blocks of 32: 5 or 4 bits, with a min for the ``_1`` types) and Q4_K
  (super-blocks of 256 with 6-bit sub-block scales and mins), bit-exact with ggml's
  ``quantize_row_*_ref``, which ``llama-quantize`` runs without an importance matrix:
  :mod:`moelab.interop.gguf_quants` (``gguf.quants``, and a numpy port for Q4_K).

Unlike ``llama-quantize``'s Q4_K_S/Q4_K_M mixes (which keep ``output.weight`` at Q6_K and some
``attn_v``/``ffn_down`` matrices at Q5_K/Q6_K), every matrix gets the one type asked for: the
file's ``general.file_type`` says MOSTLY_Q4_K_S, the mix with the fewest exceptions [I].
A matrix whose rows are not a whole number of blocks falls back as ``llama-quantize`` does
(src/llama-quant.cpp, ``tensor_type_fallback``): Q4_K → Q5_0, and a 32-block type (or Q5_0
itself) → F16; the report counts the fallbacks.

Facts moelab's config holds but GGUF has no field for are folded in exactly: a
``logit_scale`` s multiplies the final norm's weight (``W·((s·γ) ⊙ n(x))`` is the same map);
a tied head is written twice for the architectures whose ``output.weight`` is required.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.data.tokenizer import Tokenizer
from moelab.errors import InvalidValueError, MissingDependencyError
from moelab.interop.errors import UnexpectedTensorError, UnsupportedConfigError
from moelab.interop.gguf_layout import (
    GGUFArch,
    check_gguf_config,
    gguf_rules,
    resolve_gguf_arch,
    to_gguf,
)
from moelab.interop.gguf_quants import quantize_ggml
from moelab.interop.gguf_vocab import GGUFVocab, gguf_vocab, write_vocab
from moelab.models.quantized import is_quantized
from moelab.models.transformer import MoETransformer
from moelab.utils.atomic import atomic_write

OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q4_k")
"""``outtype`` values: ``auto`` keeps the model's own dtype (F32, F16 or BF16: lossless)."""

# general.file_type of each outtype (q4_k: see the module docstring)
_FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q5_1": "MOSTLY_Q5_1",
    "q5_0": "MOSTLY_Q5_0",
    "q4_1": "MOSTLY_Q4_1",
    "q4_0": "MOSTLY_Q4_0",
    "q4_k": "MOSTLY_Q4_K_S",
}
# llama-quantize's fallback when a row is not a whole number of blocks (llama-quant.cpp,
# tensor_type_fallback): Q4_K → Q5_0; a 32-block type has none, and whatever still does not
# fit becomes F16.
_FALLBACK = {"Q4_K": "Q5_0"}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without gguf
        raise MissingDependencyError(
            "writing GGUF files needs the 'gguf' package: pip install gguf"
        ) from e
    return gguf


@dataclass
class GGUFExportReport:
    """What :func:`export_gguf` wrote.

    Attributes:
        path: the file.
        arch: llama.cpp architecture (``general.architecture``).
        outtype: the matrices' type asked for (one of :data:`OUTTYPES` but ``auto``).
        tensor_types: GGML type name → number of tensors of that type.
        bytes: file size.
        tokenizer: one line describing the vocabulary written.
        chat_template: a chat template was written.
        notes: remarks (type fallbacks, folded fields, a duplicated tied head).
    """

    path: Path
    arch: str
    outtype: str
    tensor_types: dict[str, int]
    bytes: int
    tokenizer: str
    chat_template: bool
    notes: list[str] = field(default_factory=list)


def resolve_outtype(model: MoETransformer, outtype: str) -> str:
    """``outtype`` with ``auto`` replaced by the model's own dtype.

    Raises:
        ValueError: an unknown ``outtype``, or ``auto`` for a dtype GGUF has no type for.
    """
    if outtype not in OUTTYPES:
        raise InvalidValueError(f"outtype: must be one of {OUTTYPES}, got {outtype!r}")
    if outtype != "auto":
        return outtype
    dtype = model.embed.weight.dtype
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise InvalidValueError(f"outtype: 'auto' has no GGUF type for {dtype}; name one")
    return names[dtype]


def _keeps_f32(name: str, ndim: int) -> bool:
    """llama.cpp's converter keeps these F32 whatever the file type (see module docstring)."""
    gguf = _gguf()
    routers = {
        gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[k]].rsplit(".", 1)[-1]
        for k in ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP")
    }
    return (
        ndim <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or name.split(".")[-2] in routers
    )


def _encode_tensor(name: str, t: torch.Tensor, outtype: str) -> tuple[np.ndarray, Any, Any]:
    """``(data, ggml type written, ggml type asked for)`` of tensor ``name`` in a file of type
    ``outtype``: float32, float16 or the packed bytes of the block types as
    ``gguf.quants.quantize`` returns them (:func:`quantize_ggml`)."""
    gguf = _gguf()
    q = gguf.GGMLQuantizationType
    arr = t.detach().to(torch.float32).cpu().numpy()
    asked = q.F32 if _keeps_f32(name, arr.ndim) else q[outtype.upper()]
    qtype = asked
    while arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = q[_FALLBACK.get(qtype.name, "F16")]
    return quantize_ggml(arr, qtype.name), qtype, asked


def gguf_tensors(
    model: MoETransformer, arch: GGUFArch, outtype: str
) -> tuple[list[tuple[str, np.ndarray, Any]], list[str]]:
    """``([(gguf name, data, ggml type)], notes)`` of every tensor of ``model`` as ``arch``.

    Raises:
        UnexpectedTensorError: the model holds tensors the layout has no place for (adapters,
            a grown expert bank), naming them.
    """
    cfg = model.cfg
    state = dict(model.state_dict())
    notes = []
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")
        if arch.output_required:
            state["lm_head.weight"] = state["embed.weight"]
            notes.append(f"tied embeddings: {arch.name} requires output.weight, written as a copy")
    if cfg.logit_scale != 1.0:
        state["norm.weight"] = state["norm.weight"] * cfg.logit_scale
        notes.append(f"logit_scale {cfg.logit_scale:g} folded into output_norm.weight")
    rules = gguf_rules(cfg, arch)
    extra = sorted(set(state) - {r.target for r in rules})
    if extra:
        raise UnexpectedTensorError(
            f"model: tensor(s) {extra[:6]} have no place in llama.cpp's {arch.name!r} layout "
            "(merge adapters or a grown expert bank into plain weights first)"
        )
    out = []
    fallback: Counter[str] = Counter()
    for r in rules:
        for name, piece in zip(r.sources, to_gguf(r, state[r.target]), strict=True):
            data, qtype, asked = _encode_tensor(name, piece, outtype)
            if qtype != asked:
                block = _gguf().GGML_QUANT_SIZES[asked][0]
                fallback[f"rows not a multiple of {block} written as {qtype.name}"] += 1
            out.append((name, data, qtype))
    notes += [f"{n} matrices with {what}" for what, n in sorted(fallback.items())]
    return out, notes


def _write_metadata(w: Any, model: MoETransformer, arch: GGUFArch, outtype: str) -> None:
    gguf = _gguf()
    cfg = model.cfg
    w.add_type(gguf.GGUFType.MODEL)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_vocab_size(cfg.vocab_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    moe = cfg.moe
    if moe is None:
        w.add_feed_forward_length(cfg.dense_ffn_size)
    else:
        F = moe.experts.ffn_hidden_size
        if arch.expert_width_key == "feed_forward_length":
            w.add_feed_forward_length(F)
        else:  # qwen: feed_forward_length is the (unused) dense width, as HF's intermediate_size
            w.add_feed_forward_length(cfg.dense_ffn_size)
            w.add_expert_feed_forward_length(F)
        w.add_expert_count(moe.router.num_experts)
        w.add_expert_used_count(moe.router.top_k)
        if arch.shared_expert:
            w.add_expert_shared_feed_forward_length(moe.experts.shared_expert_size)
    w.add_file_type(gguf.LlamaFileType[_FILE_TYPES[outtype]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(
    model: MoETransformer,
    path: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    arch: str | None = None,
    outtype: str = "auto",
    chat_template: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> GGUFExportReport:
    """Write ``model`` (and ``tokenizer``) as the GGUF file ``path``, atomically.

    Args:
        arch: llama.cpp architecture (``llama``, ``qwen2moe``, ``qwen3moe``, ``olmoe``, or the
            HF names ``mixtral``, ...); None = inferred (dense → ``llama``).
        outtype: ``auto`` (the model's dtype), ``f32``, ``f16``, ``bf16``, ``q8_0``,
            ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0`` or ``q4_k`` (see the module docstring).
        chat_template: Jinja chat template for ``tokenizer.chat_template`` (None = none).
        bos_token, eos_token: the BOS/EOS tokens the chat template uses, when not
            ``<|endoftext|>`` (BPE tokenizers).
        name: ``general.name`` (None = the file's stem).
        overwrite: replace an existing file.
    Returns:
        A :class:`GGUFExportReport`. The file appears complete or not at all.
    Raises:
        UnsupportedConfigError: a model or tokenizer llama.cpp cannot run as it is (one line
            naming the moelab field, e.g. ``moe.router.kind``, ``experts_per_layer``,
            ``moe.experts``); UnexpectedTensorError: tensors without a GGUF place;
        ValueError: a bad ``outtype``; FileExistsError: ``path`` exists and not ``overwrite``;
        MissingDependencyError: no ``gguf`` package.
    """
    gguf = _gguf()
    if not isinstance(model, MoETransformer):
        raise TypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    path = Path(path)
    if path.is_dir():
        raise InvalidValueError(f"{path}: is a folder; give the .gguf file to write")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path}: exists (pass overwrite / --overwrite to replace it)")
    cfg = model.cfg
    outtype = resolve_outtype(model, outtype)
    spec = resolve_gguf_arch(cfg, arch)
    if is_quantized(model):
        raise UnsupportedConfigError(
            "moe.experts: quantized expert banks (moelab quantize) have no GGUF form; export "
            "the full-precision model with --outtype q8_0 instead"
        )
    check_gguf_config(cfg, spec)
    vocab: GGUFVocab = gguf_vocab(
        tokenizer, cfg.vocab_size, bos_token=bos_token, eos_token=eos_token
    )
    tensors, notes = gguf_tensors(model, spec, outtype)

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, arch=spec.name)
        w.add_name(name or path.stem)
        _write_metadata(w, model, spec, outtype)
        write_vocab(w, vocab)
        if chat_template:
            w.add_chat_template(chat_template)
        for tname, data, qtype in tensors:
            w.add_tensor(tname, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)
    return GGUFExportReport(
        path=path,
        arch=spec.name,
        outtype=outtype,
        tensor_types=dict(Counter(q.name for _, _, q in tensors)),
        bytes=path.stat().st_size,
        tokenizer=vocab.describe(),
        chat_template=bool(chat_template),
        notes=notes,
    )
