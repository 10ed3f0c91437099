"""llama.cpp's MoE architectures as GGUF files: which moelab configs each one computes exactly,
and the tensor layout between a moelab state dict and a GGUF file (both directions).

Read from llama.cpp as vendored by llama-cpp-python 0.3.36: ``src/models/{llama,qwen2moe,
qwen3moe,olmoe}.cpp`` (the tensors each architecture loads and the graph it builds),
``src/llama-graph.cpp`` (``build_moe_ffn``), ``src/llama-model.cpp``
(``llama_model_rope_type``, ``create_tensor_qkv``); tensor names come from ``gguf.constants``
(``TENSOR_NAMES``, ``MODEL_TENSORS``)::

    GGUF arch  HF arch    Q/K rows     top-k weights       shared expert     q/k norm    output.weight
    llama      mixtral    permuted     renormalised        none              none        optional (tied)
    qwen2moe   qwen2_moe  as stored    never renormalised  sigmoid-gated     none        required
    qwen3moe   qwen3_moe  as stored    renormalised        none              per head    optional (tied)
    olmoe      olmoe      as stored    never renormalised  none              whole proj  required

All four score experts with a softmax over every expert, then take the top k
(``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX``), read no ``expert_weights_scale``, make every layer
an MoE layer with one ``expert_count`` for the whole file, and load q/k/v biases only where the
file has them. ``llama`` uses the interleaved-pair ("normal") RoPE, so its Q/K rows are
permuted (:func:`permute_rope_rows`); the other three use rotate-half ("neox") RoPE, as moelab
does. qwen2moe and olmoe size the attention output ``n_embd × n_embd``, so they need
``head_dim · n_heads == d_model``; olmoe also sizes ``attn_k_norm`` ``n_embd``, so it has no
grouped-query attention. A dense moelab model (``moe=None``) is a dense ``llama``
file (no ``expert_count``).

Which moelab configs an architecture can hold reuses the Hugging Face export's refusals
(:func:`moelab.interop.hf_config.config_to_hf` of the matching HF architecture), then adds
llama.cpp's own limits (the fixed top-k renormalisation, no dense layers in an MoE file).

Tensor layout (GGUF shapes in numpy order, i.e. ggml's ``ne`` reversed)::

    moelab                              GGUF
    embed.weight [V, D]                 token_embd.weight [V, D]
    lm_head.weight [V, D]               output.weight [V, D]        (absent when tied, llama/qwen3moe)
    norm.weight [D]                     output_norm.weight [D]
    blocks.i.attn_norm.weight           blk.i.attn_norm.weight
    blocks.i.attn.{q,k,v,o}_proj.weight blk.i.attn_{q,k,v,output}.weight (Q/K rows permuted for llama)
    blocks.i.attn.{q,k,v}_proj.bias     blk.i.attn_{q,k,v}.bias     (qwen2moe)
    blocks.i.attn.{q,k}_norm.weight     blk.i.attn_{q,k}_norm.weight
    blocks.i.ffn_norm.weight            blk.i.ffn_norm.weight
    blocks.i.ffn.router.weight [E, D]   blk.i.ffn_gate_inp.weight [E, D]
    blocks.i.ffn.experts.w_gate_up      blk.i.ffn_gate_exps.weight [E, F, D] (gate half, transposed)
        [E, D, 2F]                      blk.i.ffn_up_exps.weight [E, F, D]   (up half, transposed)
    blocks.i.ffn.experts.w_down [E,F,D] blk.i.ffn_down_exps.weight [E, D, F]
    blocks.i.ffn.shared_expert.w_gate_up [D, 2Fs]  blk.i.ffn_{gate,up}_shexp.weight [Fs, D]
    blocks.i.ffn.shared_expert.w_down [Fs, D]      blk.i.ffn_down_shexp.weight [D, Fs]
    blocks.i.ffn.shared_expert.gate [1, D]         blk.i.ffn_gate_inp_shexp.weight [D]
    blocks.i.ffn.w_{gate,up,down}.weight           blk.i.ffn_{gate,up,down}.weight (dense llama)

Every conversion is a permutation, transpose, split or concatenation: an export/import round
trip at F32 is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.interop.errors import UnsupportedConfigError
from moelab.interop.hf_config import config_to_hf, infer_arch
from moelab.models.config import ModelConfig


@dataclass(frozen=True)
class GGUFArch:
    """What one llama.cpp architecture computes (see the module docstring's table).

    Attributes:
        name: ``general.architecture``.
        hf_arch: the Hugging Face architecture with the same maths (its export refusals apply).
        permute_qk: Q/K rows permuted for llama.cpp's interleaved-pair RoPE.
        norm_topk_prob: the top-k weights are renormalised (fixed by llama.cpp's graph).
        output_required: ``output.weight`` must be present (no tied-embedding fallback).
        expert_width_key: the metadata key holding each routed expert's width F.
        shared_expert: has a sigmoid-gated shared expert.
    """

    name: str
    hf_arch: str
    permute_qk: bool
    norm_topk_prob: bool
    output_required: bool
    expert_width_key: str
    shared_expert: bool = False


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "mixtral", True, True, False, "feed_forward_length"),
    "qwen2moe": GGUFArch(
        "qwen2moe", "qwen2_moe", False, False, True, "expert_feed_forward_length", True
    ),
    "qwen3moe": GGUFArch("qwen3moe", "qwen3_moe", False, True, False, "expert_feed_forward_length"),
    "olmoe": GGUFArch("olmoe", "olmoe", False, False, True, "feed_forward_length"),
}
HF_TO_GGUF = {spec.hf_arch: name for name, spec in GGUF_ARCHS.items()}


def resolve_gguf_arch(cfg: ModelConfig, arch: str | None = None) -> GGUFArch:
    """The llama.cpp architecture to write ``cfg`` as.

    Args:
        arch: a GGUF name (``llama``, ``qwen2moe``, ``qwen3moe``, ``olmoe``) or the matching
            Hugging Face name (``mixtral``, ``qwen2_moe``, ...); None = ``llama`` for a dense
            model, else the architecture :func:`~moelab.interop.hf_config.infer_arch` picks.
    Raises:
        UnsupportedConfigError: an unknown ``arch``.
    """
    if arch is None:
        arch = "llama" if cfg.moe is None else HF_TO_GGUF[infer_arch(cfg)]
    arch = HF_TO_GGUF.get(arch, arch)
    if arch not in GGUF_ARCHS:
        known = sorted(GGUF_ARCHS) + sorted(HF_TO_GGUF)
        raise UnsupportedConfigError(f"arch: must be one of {known}, got {arch!r}")
    return GGUF_ARCHS[arch]


def _require(cond: bool, field: str, arch: GGUFArch, msg: str) -> None:
    if not cond:
        raise UnsupportedConfigError(f"{field}: llama.cpp's {arch.name!r} architecture {msg}")


def _dense_layer_field(cfg: ModelConfig) -> str:
    """The config field that makes some layer of an MoE model dense."""
    if cfg.moe_layers is not None:
        return "moe_layers"
    return "first_dense_layers" if cfg.first_dense_layers else "moe_layer_step"


def check_gguf_config(cfg: ModelConfig, arch: GGUFArch) -> None:
    """Refuse a config that llama.cpp's ``arch`` would compute differently.

    Raises:
        UnsupportedConfigError: one line naming the moelab field (e.g. ``moe.router.kind``,
            ``experts_per_layer``, ``latent_moe``, ``objective``, ``moe.router.input_size``).
    """
    _require(
        cfg.objective == "causal",
        "objective",
        arch,
        f"runs causal LMs only, got {cfg.objective!r} (a block-diffusion model decodes "
        "masked blocks, which llama.cpp cannot)",
    )
    _require(cfg.latent_moe is None, "latent_moe", arch, "has no Multi-Head LatentMoE layers")
    if cfg.moe is None:
        _require(arch.name == "llama", "moe", arch, "needs MoE layers (a dense model is 'llama')")
        _require(cfg.qk_norm == "none", "qk_norm", arch, f"has no q/k norm, got {cfg.qk_norm!r}")
        _require(not cfg.attention_bias, "attention_bias", arch, "is written without q/k/v biases")
        return
    try:
        config_to_hf(cfg, arch.hf_arch)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(
            f"{e} (llama.cpp's {arch.name!r} runs {arch.hf_arch} models)"
        ) from e
    r = cfg.moe.router
    _require(
        r.norm_topk_prob == arch.norm_topk_prob,
        "moe.router.norm_topk_prob",
        arch,
        f"{'always' if arch.norm_topk_prob else 'never'} renormalises the top-k weights, "
        f"got {r.norm_topk_prob}",
    )
    _require(
        all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
        _dense_layer_field(cfg),
        arch,
        "makes every layer an MoE layer (no dense layers between them)",
    )
    _require(
        arch.name != "olmoe" or cfg.n_kv_heads == cfg.n_heads,
        "n_kv_heads",
        arch,
        f"sizes attn_k_norm by d_model, so needs n_kv_heads == n_heads ({cfg.n_kv_heads} != "
        f"{cfg.n_heads})",
    )
    _require(
        arch.name not in ("qwen2moe", "olmoe") or cfg.head_dim * cfg.n_heads == cfg.d_model,
        "head_dim",
        arch,
        f"needs head_dim·n_heads == d_model ({cfg.head_dim}·{cfg.n_heads} != {cfg.d_model})",
    )


# ----------------------------------------------------------------------- RoPE rows
def permute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` ``LlamaModel.permute``).

    Within each head, rows ``[x_0..x_{hd/2-1}, y_0..y_{hd/2-1}]`` (rotate-half pairs
    ``(x_i, y_i)``) become ``[x_0, y_0, x_1, y_1, ...]`` (interleaved pairs), so llama.cpp's
    interleaved-pair RoPE computes what rotate-half RoPE computes on the original rows.

    Args:
        w: ``[n_heads·hd, ...]`` projection weight (``nn.Linear`` layout) or bias.
        n_heads: heads of this projection (query heads for Q, key/value heads for K).
    Raises:
        ValueError: ``2·n_heads`` does not divide the rows.
    """
    out_dim = w.shape[0]
    if out_dim % (2 * n_heads):
        raise InvalidValueError(
            f"n_heads: {n_heads} heads with even head_dim must divide {out_dim} rows"
        )
    hd = out_dim // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of :func:`permute_rope_rows`: interleaved-pair rows back to rotate-half rows."""
    out_dim = w.shape[0]
    if out_dim % (2 * n_heads):
        raise InvalidValueError(
            f"n_heads: {n_heads} heads with even head_dim must divide {out_dim} rows"
        )
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class GGUFRule:
    """One moelab tensor and the GGUF tensor(s) it becomes.

    Attributes:
        target: moelab state-dict name.
        sources: GGUF tensor names, in the order ``op`` produces them.
        op: ``"copy"``; ``"rope"`` (rows permuted over ``heads``); ``"flat"`` (``[1, D]`` ↔
            ``[D]``); ``"T"`` (2-D transpose); ``"pair_T"`` (``[D, 2F]`` ↔ gate, up
            ``[F, D]``); ``"T12"`` (``[E, a, b]`` ↔ ``[E, b, a]``); ``"pair_T12"``
            (``[E, D, 2F]`` ↔ gate, up ``[E, F, D]``).
        heads: heads of a ``"rope"`` projection.
    """

    target: str
    sources: tuple[str, ...]
    op: str
    heads: int = 0


def tensor_name(kind: str, bid: int | None = None, suffix: str = "weight") -> str:
    """The GGUF name of tensor ``kind`` (a ``gguf.MODEL_TENSOR`` member name such as
    ``"FFN_GATE_EXP"``) of block ``bid``, from ``gguf.TENSOR_NAMES``."""
    import gguf

    base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]]
    return f"{base.format(bid=bid) if bid is not None else base}.{suffix}"


def gguf_rules(cfg: ModelConfig, arch: GGUFArch) -> list[GGUFRule]:
    """Every rule of a :class:`~moelab.models.MoETransformer` of config ``cfg`` written as
    ``arch`` (``lm_head`` only when embeddings are untied or ``arch`` requires it)."""
    rules = [
        GGUFRule("embed.weight", (tensor_name("TOKEN_EMBD"),), "copy"),
        GGUFRule("norm.weight", (tensor_name("OUTPUT_NORM"),), "copy"),
    ]
    if not cfg.tie_embeddings or arch.output_required:
        rules.append(GGUFRule("lm_head.weight", (tensor_name("OUTPUT"),), "copy"))
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        rules += [
            GGUFRule(b + "attn_norm.weight", (tensor_name("ATTN_NORM", i),), "copy"),
            GGUFRule(b + "ffn_norm.weight", (tensor_name("FFN_NORM", i),), "copy"),
        ]
        for proj, kind, heads in (
            ("q", "ATTN_Q", cfg.n_heads),
            ("k", "ATTN_K", cfg.n_kv_heads),
            ("v", "ATTN_V", 0),
        ):
            op = "rope" if heads and arch.permute_qk else "copy"
            rules.append(
                GGUFRule(f"{b}attn.{proj}_proj.weight", (tensor_name(kind, i),), op, heads)
            )
            if cfg.attention_bias:
                rules.append(
                    GGUFRule(
                        f"{b}attn.{proj}_proj.bias", (tensor_name(kind, i, "bias"),), op, heads
                    )
                )
        rules.append(GGUFRule(b + "attn.o_proj.weight", (tensor_name("ATTN_OUT", i),), "copy"))
        if cfg.qk_norm != "none":
            rules.append(
                GGUFRule(b + "attn.q_norm.weight", (tensor_name("ATTN_Q_NORM", i),), "copy")
            )
            rules.append(
                GGUFRule(b + "attn.k_norm.weight", (tensor_name("ATTN_K_NORM", i),), "copy")
            )
        f = b + "ffn."
        if not cfg.is_moe_layer(i):
            for proj, kind in (("gate", "FFN_GATE"), ("up", "FFN_UP"), ("down", "FFN_DOWN")):
                rules.append(GGUFRule(f"{f}w_{proj}.weight", (tensor_name(kind, i),), "copy"))
            continue
        rules += [
            GGUFRule(f + "router.weight", (tensor_name("FFN_GATE_INP", i),), "copy"),
            GGUFRule(
                f + "experts.w_gate_up",
                (tensor_name("FFN_GATE_EXP", i), tensor_name("FFN_UP_EXP", i)),
                "pair_T12",
            ),
            GGUFRule(f + "experts.w_down", (tensor_name("FFN_DOWN_EXP", i),), "T12"),
        ]
        if arch.shared_expert:
            s = f + "shared_expert."
            rules += [
                GGUFRule(
                    s + "w_gate_up",
                    (tensor_name("FFN_GATE_SHEXP", i), tensor_name("FFN_UP_SHEXP", i)),
                    "pair_T",
                ),
                GGUFRule(s + "w_down", (tensor_name("FFN_DOWN_SHEXP", i),), "T"),
                GGUFRule(s + "gate", (tensor_name("FFN_GATE_INP_SHEXP", i),), "flat"),
            ]
    return rules


def to_gguf(rule: GGUFRule, t: Tensor) -> list[Tensor]:
    """The GGUF tensor(s) of moelab tensor ``t`` under ``rule`` (contiguous)."""
    op = rule.op
    if op == "copy":
        out = [t]
    elif op == "rope":
        out = [permute_rope_rows(t, rule.heads)]
    elif op == "flat":
        out = [t.reshape(-1)]
    elif op == "T":
        out = [t.T]
    elif op == "pair_T":
        out = list(t.T.chunk(2, dim=0))
    elif op == "T12":
        out = [t.transpose(1, 2)]
    elif op == "pair_T12":
        out = list(t.transpose(1, 2).chunk(2, dim=1))
    else:  # pragma: no cover - programming error
        raise AssertionError(op)
    return [x.contiguous() for x in out]


def from_gguf(rule: GGUFRule, ts: list[Tensor]) -> Tensor:
    """Inverse of :func:`to_gguf`: the moelab tensor of the GGUF tensors ``ts``."""
    op = rule.op
    if op == "copy":
        out = ts[0]
    elif op == "rope":
        out = unpermute_rope_rows(ts[0], rule.heads)
    elif op == "flat":
        out = ts[0].reshape(1, -1)
    elif op == "T":
        out = ts[0].T
    elif op == "pair_T":
        out = torch.cat(ts, dim=0).T
    elif op == "T12":
        out = ts[0].transpose(1, 2)
    elif op == "pair_T12":
        out = torch.cat(ts, dim=1).transpose(1, 2)
    else:  # pragma: no cover
        raise AssertionError(op)
    return out.contiguous()
