"""Tensor-name and layout mapping between Hugging Face MoE checkpoints and moelab state dicts.

Layouts (checked against transformers 5.24 source):

- ``"fused"`` — transformers v5 modules (``models/*/modeling_*.py``: ``MixtralExperts``,
  ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``DeepseekV3Experts``) hold
  ``mlp.experts.gate_up_proj [E, 2F, D]`` and ``mlp.experts.down_proj [E, D, F]`` and compute
  ``F.linear(x, gate_up_proj[e]).chunk(2)`` (gate block first, then up) and
  ``F.linear(h, down_proj[e])``: each expert slice is in ``nn.Linear`` orientation
  ``[out, in]``. The router is ``mlp.gate.weight [E, D]``. ``save_pretrained(...,
  save_original_format=False)`` writes this layout.
- ``"per_expert"`` — the Hub's (transformers v4) layout, which v5 converts at load time and
  writes back by default (``conversion_mapping.py``: ``WeightConverter(
  ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"] → "mlp.experts.gate_up_proj",
  [MergeModulelist(dim=0), Concatenate(dim=1)])``; for Mixtral ``WeightRenaming(
  ".block_sparse_moe.", ".mlp.")`` and ``w1``/``w3`` (gate/up), ``w2`` (down)): one
  ``nn.Linear`` per expert, ``gate_proj/up_proj [F, D]``, ``down_proj [D, F]``.

moelab stores experts input-major: ``w_gate_up [E, D, 2F]`` (gate block first) and
``w_down [E, F, D]``, so both layouts transpose the last two axes. The transposition is decided
by the layout and the tensor's role (its name), never by comparing shapes, so ``D == F`` is
handled. Every conversion is a pure permutation/concatenation: an import/export round trip is
bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.interop.errors import (
    ConfigMismatchError,
    InteropError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedConfigError,
)
from moelab.models.config import ModelConfig

LAYOUTS = ("per_expert", "fused")

Dim = tuple[str, int]  # (config field that sets it, size)


@dataclass(frozen=True)
class Rule:
    """One moelab tensor made from one or more HF tensors.

    Attributes:
        target: moelab state-dict name.
        sources: HF tensor names, in the order ``op`` consumes them.
        shapes: expected HF shape of each source, each axis labelled by its config field.
        op: ``"copy"``; ``"T"`` (2-D transpose); ``"pair_T"`` (gate, up ``[F, D]`` →
            ``cat(gate, up).T [D, 2F]``); ``"T12"`` (``[E, a, b] → [E, b, a]``);
            ``"stack_T12"`` (E tensors ``[a, b]`` → ``[E, b, a]``); ``"stack_pairs_T12"``
            (E (gate, up) pairs ``[F, D]`` → ``[E, D, 2F]``).
    """

    target: str
    sources: tuple[str, ...]
    shapes: tuple[tuple[Dim, ...], ...]
    op: str


def to_moelab(op: str, ts: list[Tensor]) -> Tensor:
    """Apply rule ``op`` to the HF tensors ``ts`` (see :class:`Rule`)."""
    if op == "copy":
        out = ts[0]
    elif op == "T":
        out = ts[0].T
    elif op == "pair_T":
        out = torch.cat(ts, dim=0).T
    elif op == "T12":
        out = ts[0].transpose(1, 2)
    elif op == "stack_T12":
        out = torch.stack(ts).transpose(1, 2)
    elif op == "stack_pairs_T12":
        pairs = [torch.cat(ts[i : i + 2], dim=0) for i in range(0, len(ts), 2)]
        out = torch.stack(pairs).transpose(1, 2)
    else:  # pragma: no cover - programming error
        raise AssertionError(op)
    return out.contiguous()


def to_hf(op: str, t: Tensor, n_sources: int) -> list[Tensor]:
    """Inverse of :func:`to_moelab`: the HF tensors of moelab tensor ``t``."""
    if op == "copy":
        out = [t]
    elif op == "T":
        out = [t.T]
    elif op == "pair_T":
        out = list(t.T.chunk(2, dim=0))
    elif op == "T12":
        out = [t.transpose(1, 2)]
    elif op == "stack_T12":
        out = list(t.transpose(1, 2).unbind(0))
    elif op == "stack_pairs_T12":
        out = [half for e in t.transpose(1, 2).unbind(0) for half in e.chunk(2, dim=0)]
    else:  # pragma: no cover
        raise AssertionError(op)
    if len(out) != n_sources:
        raise TensorShapeError(
            f"{op}: the moelab tensor of shape {tuple(t.shape)} splits into {len(out)} HF "
            f"tensors, the config expects {n_sources}"
        )
    return [x.contiguous() for x in out]


# --------------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Dims:
    """Sizes of one architecture's tensors, each with the config field that sets it."""

    vocab: Dim
    hidden: Dim
    q: Dim
    kv: Dim
    head: Dim
    experts: Dim
    expert_ffn: Dim
    shared_ffn: Dim | None = None
    dense_ffn: Dim | None = None


def _expert_rules(
    src: str, dst: str, d: Dims, layout: str, names: tuple[str, str, str]
) -> list[Rule]:
    """Rules of the routed experts of one layer (``src`` = HF module prefix with dot)."""
    E = d.experts[1]
    two_f = (f"2*{d.expert_ffn[0]}", 2 * d.expert_ffn[1])
    if layout == "fused":
        return [
            Rule(
                f"{dst}experts.w_gate_up",
                (f"{src}experts.gate_up_proj",),
                ((d.experts, two_f, d.hidden),),
                "T12",
            ),
            Rule(
                f"{dst}experts.w_down",
                (f"{src}experts.down_proj",),
                ((d.experts, d.hidden, d.expert_ffn),),
                "T12",
            ),
        ]
    g, u, dn = names
    gate_up = tuple(f"{src}experts.{e}.{n}.weight" for e in range(E) for n in (g, u))
    down = tuple(f"{src}experts.{e}.{dn}.weight" for e in range(E))
    return [
        Rule(
            f"{dst}experts.w_gate_up",
            gate_up,
            ((d.expert_ffn, d.hidden),) * (2 * E),
            "stack_pairs_T12",
        ),
        Rule(f"{dst}experts.w_down", down, ((d.hidden, d.expert_ffn),) * E, "stack_T12"),
    ]


def _mlp_rules(src: str, dst: str, hidden: Dim, ffn: Dim, moelab_style: str) -> list[Rule]:
    """A dense SwiGLU MLP ``gate_proj/up_proj/down_proj`` (``moelab_style``: ``"dense"`` for
    :class:`SwiGLUFFN`, ``"shared"`` for :class:`SharedExpert`)."""
    if moelab_style == "dense":
        return [
            Rule(f"{dst}w_gate.weight", (f"{src}gate_proj.weight",), ((ffn, hidden),), "copy"),
            Rule(f"{dst}w_up.weight", (f"{src}up_proj.weight",), ((ffn, hidden),), "copy"),
            Rule(f"{dst}w_down.weight", (f"{src}down_proj.weight",), ((hidden, ffn),), "copy"),
        ]
    return [
        Rule(
            f"{dst}w_gate_up",
            (f"{src}gate_proj.weight", f"{src}up_proj.weight"),
            ((ffn, hidden), (ffn, hidden)),
            "pair_T",
        ),
        Rule(f"{dst}w_down", (f"{src}down_proj.weight",), ((hidden, ffn),), "T"),
    ]


def moe_block_rules(
    src: str,
    dst: str,
    d: Dims,
    layout: str,
    *,
    arch: str,
    expert_bias: bool = False,
) -> list[Rule]:
    """Rules of one MoE feed-forward block: router, experts, shared expert(s).

    ``src``: HF prefix of the block (e.g. ``"model.layers.3.mlp."``); ``dst``: moelab prefix
    (e.g. ``"blocks.3.ffn."``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {LAYOUTS}, got {layout!r}")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    rules = [Rule(f"{dst}router.weight", (f"{src}gate.weight",), ((d.experts, d.hidden),), "copy")]
    if expert_bias:
        rules.append(
            Rule(
                f"{dst}router.expert_bias",
                (f"{src}gate.e_score_correction_bias",),
                ((d.experts,),),
                "copy",
            )
        )
    rules += _expert_rules(src, dst, d, layout, names)
    if arch == "qwen2_moe":
        if d.shared_ffn is None:
            raise UnsupportedConfigError("shared_expert_size: qwen2_moe needs a shared expert")
        rules += _mlp_rules(
            f"{src}shared_expert.", f"{dst}shared_expert.", d.hidden, d.shared_ffn, "shared"
        )
        rules.append(
            Rule(
                f"{dst}shared_expert.gate",
                (f"{src}shared_expert_gate.weight",),
                ((("1", 1), d.hidden),),
                "copy",
            )
        )
    elif arch == "deepseek_v3" and d.shared_ffn is not None:
        rules += _mlp_rules(
            f"{src}shared_experts.", f"{dst}shared_expert.", d.hidden, d.shared_ffn, "shared"
        )
    return rules


def model_rules(cfg: ModelConfig, arch: str, layout: str) -> list[Rule]:
    """Every rule of a whole :class:`~moelab.models.MoETransformer` of config ``cfg`` as HF
    architecture ``arch`` (the LM head only when embeddings are untied)."""
    from moelab.interop.hf_config import ARCHS

    spec = ARCHS[arch]
    moe = cfg.moe
    if moe is None:
        raise UnsupportedConfigError(f"moe: {arch} needs MoE layers (got a dense model)")
    q_w, kv_w = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    d = Dims(
        vocab=("vocab_size", cfg.vocab_size),
        hidden=("hidden_size", cfg.d_model),
        q=("num_attention_heads*head_dim", q_w),
        kv=("num_key_value_heads*head_dim", kv_w),
        head=("head_dim", cfg.head_dim),
        experts=(spec.num_experts_field, moe.router.num_experts),
        expert_ffn=(spec.expert_size_field, moe.experts.ffn_hidden_size),
        shared_ffn=("shared_expert_intermediate_size", moe.experts.shared_expert_size),
        dense_ffn=("intermediate_size", cfg.dense_ffn_size),
    )
    H = d.hidden
    rules = [Rule("embed.weight", ("model.embed_tokens.weight",), ((d.vocab, H),), "copy")]
    for i in range(cfg.n_layers):
        s, t = f"model.layers.{i}.", f"blocks.{i}."
        a, b = f"{s}self_attn.", f"{t}attn."
        rules += [
            Rule(f"{t}attn_norm.weight", (f"{s}input_layernorm.weight",), ((H,),), "copy"),
            Rule(f"{t}ffn_norm.weight", (f"{s}post_attention_layernorm.weight",), ((H,),), "copy"),
            Rule(f"{b}q_proj.weight", (f"{a}q_proj.weight",), ((d.q, H),), "copy"),
            Rule(f"{b}k_proj.weight", (f"{a}k_proj.weight",), ((d.kv, H),), "copy"),
            Rule(f"{b}v_proj.weight", (f"{a}v_proj.weight",), ((d.kv, H),), "copy"),
            Rule(f"{b}o_proj.weight", (f"{a}o_proj.weight",), ((H, d.q),), "copy"),
        ]
        if cfg.attention_bias:
            for p, w in (("q", d.q), ("k", d.kv), ("v", d.kv)):
                rules.append(Rule(f"{b}{p}_proj.bias", (f"{a}{p}_proj.bias",), ((w,),), "copy"))
        if cfg.qk_norm != "none":
            qn, kn = (d.head, d.head) if cfg.qk_norm == "head" else (d.q, d.kv)
            rules.append(Rule(f"{b}q_norm.weight", (f"{a}q_norm.weight",), ((qn,),), "copy"))
            rules.append(Rule(f"{b}k_norm.weight", (f"{a}k_norm.weight",), ((kn,),), "copy"))
        if cfg.is_moe_layer(i):
            hf_moe = "block_sparse_moe." if arch == "mixtral" and layout == "per_expert" else "mlp."
            rules += moe_block_rules(f"{s}{hf_moe}", f"{t}ffn.", d, layout, arch=arch)
        else:
            rules += _mlp_rules(f"{s}mlp.", f"{t}ffn.", H, d.dense_ffn, "dense")
    rules.append(Rule("norm.weight", ("model.norm.weight",), ((H,),), "copy"))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",), ((d.vocab, H),), "copy"))
    return rules


# --------------------------------------------------------------------------- apply
def detect_layout(names: Iterable[str]) -> str:
    """``"fused"`` or ``"per_expert"`` from the tensor names (per_expert when no experts).

    Raises:
        InteropError: both layouts appear in one checkpoint.
    """
    fused = per = None
    for n in names:
        if re.search(r"(^|\.)experts\.(gate_up_proj|down_proj)$", n):
            fused = fused or n
        elif re.search(r"(^|\.)experts\.\d+\.", n):
            per = per or n
    if fused and per:
        raise InteropError(
            f"checkpoint mixes the fused expert layout ({fused!r}) and the per-expert layout "
            f"({per!r})"
        )
    return "fused" if fused else "per_expert"


def _fmt_shape(shape: tuple[Dim, ...]) -> str:
    return "(" + ", ".join(str(v) for _, v in shape) + ")"


def apply_import(
    rules: list[Rule], tensors: Mapping[str, Tensor], where: str = "checkpoint"
) -> dict[str, Tensor]:
    """Build the moelab state dict from HF ``tensors`` following ``rules``, strictly.

    Raises:
        MissingTensorError: a source tensor is absent (names it).
        UnexpectedTensorError: ``tensors`` holds names no rule uses (names them).
        TensorShapeError: a tensor's shape differs from the config's (names tensor, both
            shapes and the config fields that set the expected one).
    """
    used = {s for r in rules for s in r.sources}
    extra = sorted(set(tensors) - used)
    if extra:
        shown = extra[:8] + (["…"] if len(extra) > 8 else [])
        raise UnexpectedTensorError(
            f"{where}: {len(extra)} unexpected tensor(s) the converter has no place for: {shown}"
        )
    missing = sorted(used - set(tensors))
    if missing:
        shown = missing[:8] + (["…"] if len(missing) > 8 else [])
        raise MissingTensorError(f"{where}: {len(missing)} missing tensor(s): {shown}")
    out: dict[str, Tensor] = {}
    for r in rules:
        ts = [tensors[s] for s in r.sources]
        for name, t, shape in zip(r.sources, ts, r.shapes, strict=True):
            want = tuple(v for _, v in shape)
            if tuple(t.shape) != want:
                fields = ", ".join(f"{f}={v}" for f, v in shape)
                raise TensorShapeError(
                    f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies "
                    f"{want} ({fields})"
                )
        out[r.target] = to_moelab(r.op, ts)
    return out


def apply_export(rules: list[Rule], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The HF tensors of moelab ``state`` following ``rules``; every state entry must be used.

    Raises:
        UnexpectedTensorError: a moelab tensor has no HF counterpart (it would be dropped).
        MissingTensorError: a rule's moelab tensor is absent.
    """
    targets = {r.target for r in rules}
    extra = sorted(set(state) - targets)
    if extra:
        raise UnexpectedTensorError(
            f"moelab model: tensor(s) {extra} have no place in the Hugging Face layout"
        )
    out: dict[str, Tensor] = {}
    for r in rules:
        if r.target not in state:
            raise MissingTensorError(f"moelab model: missing tensor {r.target!r}")
        t = state[r.target].detach().cpu()
        for name, piece in zip(r.sources, to_hf(r.op, t, len(r.sources)), strict=True):
            out[name] = piece
    return out


def check_counts(names: Iterable[str], n_layers: int, experts: Dim, layout: str) -> None:
    """Layer and expert counts in tensor names versus config.json (per-expert layout).

    Raises:
        ConfigMismatchError: naming ``num_hidden_layers`` or the experts field.
    """
    layers: set[int] = set()
    expert_ids: set[int] = set()
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m:
            layers.add(int(m.group(1)))
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m:
            expert_ids.add(int(m.group(1)))
    if layers and layers != set(range(n_layers)):
        raise ConfigMismatchError(
            f"num_hidden_layers: config.json says {n_layers}, the weights hold layers "
            f"{min(layers)}..{max(layers)} ({len(layers)} layers)"
        )
    if layout == "per_expert" and expert_ids and expert_ids != set(range(experts[1])):
        raise ConfigMismatchError(
            f"{experts[0]}: config.json says {experts[1]}, the weights hold experts "
            f"{min(expert_ids)}..{max(expert_ids)} ({len(expert_ids)} experts)"
        )
