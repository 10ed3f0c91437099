"""Typed config of the decoder-only MoE transformer LM (and its dense twin).

Field names follow Llama / Hugging Face where they exist (``n_kv_heads`` is
``num_key_value_heads``, ``first_dense_layers`` is DeepSeek's ``first_k_dense_replace``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.latent_moe import LatentMoEConfig
from moelab.errors import InvalidValueError, require
from moelab.utils.fields import check_fields

OBJECTIVES = ("causal", "block_diffusion")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def default_dense_ffn_size(d_model: int) -> int:
    """Llama's SwiGLU width rule ``2/3 · 4·d_model``, rounded up to a multiple of 8."""
    f = (8 * d_model) // 3
    return -(-f // 8) * 8


@dataclass
class ModelConfig:
    """A decoder-only transformer LM whose feed-forward layers are MoE layers.

    Layer ``i`` is an MoE layer when ``moe is not None`` and either ``i`` is in
    ``moe_layers`` (an explicit placement) or, without one, ``i >= first_dense_layers`` and
    ``(i + 1) % moe_layer_step == 0``; every other layer has one dense SwiGLU FFN of width ``dense_ffn_size``. ``moe=None`` is a fully
    dense model (what :func:`moelab.models.dense_twin.dense_twin_config` produces).

    Attributes:
        vocab_size: V, token vocabulary size (>= 1).
        d_model: D, residual stream width; must equal ``moe.experts.hidden_size``.
        n_layers: L, decoder blocks (>= 1).
        n_heads: H, query heads.
        n_kv_heads: key/value heads for grouped-query attention (GQA; Ainslie et al. 2023,
            arXiv 2305.13245); must divide ``n_heads``. ``None`` means ``n_heads`` (MHA).
        head_dim: per-head width; ``None`` means ``d_model // n_heads`` (then ``n_heads`` must
            divide ``d_model``). Must be even (rotary embeddings rotate pairs).
        max_seq_len: longest sequence (positions ``0 .. max_seq_len-1``), sizes the RoPE cache.
        rope_theta: RoPE base θ (Su et al. 2021, arXiv 2104.09864; Llama uses 10000 / 500000).
        norm_eps: ε of RMSNorm.
        tie_embeddings: share the input embedding matrix with the LM head (saved once).
        logit_scale: a fixed (not trained) factor on the logits, ``logits = s · lm_head(h)``;
            1 for every freshly built model. SPARKLING's hidden-size expansion of a model with
            tied embeddings sets it to the LM head's fan-in factor (½ at 2×; arXiv 2602.02472
            App. D.1), since the shared matrix cannot be scaled as a head without also
            scaling it as an embedding (:mod:`moelab.train.expand`). Must be > 0.
        attention_bias: q/k/v projections have biases (Qwen2-MoE ``qkv_bias``); the output
            projection never has one.
        qk_norm: RMSNorm of queries and keys before RoPE: ``"none"``; ``"head"`` over each
            head's ``head_dim`` features, one weight shared by all heads (Qwen3-MoE);
            ``"full"`` over all heads' width at once (OLMoE ``q_norm [H·hd]``,
            ``k_norm [H_kv·hd]``). Uses ``norm_eps``.
        first_dense_layers: the first n layers use a dense FFN instead of MoE (DeepSeek-V2/V3
            ``first_k_dense_replace``); in ``[0, n_layers]``.
        moe_layer_step: interleaved MoE layers: one MoE layer every ``moe_layer_step``
            layers, at layers ``step-1, 2·step-1, ...`` (HF Qwen2/3-MoE
            ``decoder_sparse_step``, Llama-4 ``interleave_moe_layer_step``); 1 = every layer.
            Megatron's integer ``moe_layer_freq`` N puts MoE at layers ``0, N, 2N, ...``
            instead; that is ``moe_layer_step=N`` shifted by one (ours follows the importable
            checkpoints).
        moe_layers: an explicit set of MoE layer indices (sorted, distinct, in
            ``[0, n_layers)``; may be empty), for placements the two rules above cannot
            express (HF Qwen2/3-MoE ``mlp_only_layers`` anywhere, selective upcycling of
            chosen layers). ``None`` = the ``first_dense_layers``/``moe_layer_step`` rule;
            given, those two must keep their defaults (0 and 1). Needs ``moe``.
        dense_ffn_size: hidden width of every dense SwiGLU FFN; ``None`` means
            :func:`default_dense_ffn_size` (``8·D/3`` rounded up to a multiple of 8).
        init_std: std of the normal weight initialisation (residual output projections use
            ``init_std / sqrt(2·n_layers)``; see :meth:`MoETransformer.reset_parameters`).
        moe: the config of every MoE layer, or ``None`` for a dense model.
        experts_per_layer: routed experts of each MoE layer in depth order (one entry per MoE
            layer), for models whose layers keep different numbers of experts (expert
            pruning); ``None`` means ``moe.router.num_experts`` everywhere. Layer i's top-k is
            ``min(moe.router.top_k, experts_per_layer[i])``; see :meth:`moe_config`.
        latent_moe: Multi-Head LatentMoE instead of dense FFNs in layers
            ``>= first_dense_layers`` (:mod:`moelab.core.latent_moe`); needs ``moe=None``.
        objective: ``"causal"`` (next-token LM, the default) or ``"block_diffusion"``
            (masked block diffusion as SDAR / BD3-LM: bidirectional attention inside blocks
            of ``block_size`` tokens, causal across blocks; see
            :mod:`moelab.models.block_diffusion`). A block-diffusion model's vocabulary is
            the tokenizer's plus one mask token, whose id is the last one,
            ``vocab_size - 1`` (:attr:`mask_token_id`).
        block_size: tokens per diffusion block (>= 1); read only by ``"block_diffusion"``.

    Raises:
        ValueError: naming the offending field and the accepted range.
    """

    vocab_size: int = 32000
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    logit_scale: float = 1.0
    attention_bias: bool = False
    qk_norm: str = "none"
    first_dense_layers: int = 0
    moe_layer_step: int = 1
    moe_layers: tuple[int, ...] | None = None
    dense_ffn_size: int | None = None
    init_std: float = 0.02
    moe: MoEConfig | None = field(default_factory=MoEConfig)
    experts_per_layer: tuple[int, ...] | None = None
    latent_moe: LatentMoEConfig | None = None
    objective: str = "causal"
    block_size: int = 8

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            require(_is_int(v) and v >= 1, name, f"must be an int >= 1, got {v!r}")
        H = self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = H
        kv = self.n_kv_heads
        require(
            _is_int(kv) and 1 <= kv <= H and H % kv == 0,
            "n_kv_heads",
            f"must be an int in [1, n_heads={H}] dividing n_heads, got {kv!r}",
        )
        if self.head_dim is None:
            require(
                self.d_model % H == 0,
                "head_dim",
                f"not given and n_heads={H} does not divide d_model={self.d_model}; set it",
            )
            self.head_dim = self.d_model // H
        hd = self.head_dim
        require(
            _is_int(hd) and hd >= 2 and hd % 2 == 0,
            "head_dim",
            f"must be an even int >= 2 (RoPE rotates pairs), got {hd!r}",
        )
        require(
            isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0,
            "rope_theta",
            f"must be > 0, got {self.rope_theta!r}",
        )
        require(
            isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0,
            "norm_eps",
            f"must be > 0, got {self.norm_eps!r}",
        )
        require(
            isinstance(self.tie_embeddings, bool),
            "tie_embeddings",
            f"must be a bool, got {self.tie_embeddings!r}",
        )
        require(
            isinstance(self.logit_scale, (int, float))
            and not isinstance(self.logit_scale, bool)
            and math.isfinite(self.logit_scale)
            and self.logit_scale > 0,
            "logit_scale",
            f"must be a finite number > 0, got {self.logit_scale!r}",
        )
        require(
            isinstance(self.attention_bias, bool),
            "attention_bias",
            f"must be a bool, got {self.attention_bias!r}",
        )
        require(
            self.qk_norm in ("none", "head", "full"),
            "qk_norm",
            f"must be 'none', 'head' or 'full', got {self.qk_norm!r}",
        )
        fd = self.first_dense_layers
        require(
            _is_int(fd) and 0 <= fd <= self.n_layers,
            "first_dense_layers",
            f"must be an int in [0, n_layers={self.n_layers}], got {fd!r}",
        )
        step = self.moe_layer_step
        require(
            _is_int(step) and 1 <= step <= self.n_layers,
            "moe_layer_step",
            f"must be an int in [1, n_layers={self.n_layers}], got {step!r}",
        )
        self._check_moe_layers()
        if self.dense_ffn_size is None:
            self.dense_ffn_size = default_dense_ffn_size(self.d_model)
        require(
            _is_int(self.dense_ffn_size) and self.dense_ffn_size >= 1,
            "dense_ffn_size",
            f"must be an int >= 1, got {self.dense_ffn_size!r}",
        )
        require(
            isinstance(self.init_std, (int, float)) and self.init_std > 0,
            "init_std",
            f"must be > 0, got {self.init_std!r}",
        )
        require(
            self.objective in OBJECTIVES,
            "objective",
            f"must be one of {OBJECTIVES}, got {self.objective!r}",
        )
        require(
            _is_int(self.block_size) and 1 <= self.block_size <= self.max_seq_len,
            "block_size",
            f"must be an int in [1, max_seq_len={self.max_seq_len}], got {self.block_size!r}",
        )
        if self.objective == "block_diffusion":
            require(self.vocab_size >= 2, "vocab_size", "needs >= 2 ids (one is the mask token)")
        if self.moe is not None:
            require(
                isinstance(self.moe, MoEConfig),
                "moe",
                f"must be a MoEConfig or None, got {type(self.moe).__name__}",
            )
            hs = self.moe.experts.hidden_size
            require(
                hs == self.d_model,
                "moe.experts.hidden_size",
                f"must equal d_model={self.d_model}, got {hs}",
            )
        self._check_experts_per_layer()
        if self.latent_moe is not None:
            require(
                isinstance(self.latent_moe, LatentMoEConfig) and self.moe is None,
                "latent_moe",
                "must be a LatentMoEConfig, with moe=None (one kind of sparse FFN per model)",
            )

    def _check_moe_layers(self) -> None:
        layers = self.moe_layers
        if layers is None:
            return
        L = self.n_layers
        require(
            isinstance(layers, (tuple, list))
            and all(_is_int(i) and 0 <= i < L for i in layers)
            and list(layers) == sorted(set(layers)),
            "moe_layers",
            f"must be None or sorted distinct ints in [0, n_layers={L}), got {layers!r}",
        )
        require(
            self.first_dense_layers == 0 and self.moe_layer_step == 1,
            "moe_layers",
            "an explicit placement replaces first_dense_layers and moe_layer_step; leave them "
            f"at 0 and 1 (got {self.first_dense_layers} and {self.moe_layer_step})",
        )
        require(self.moe is not None, "moe_layers", "needs moe (a dense model has no MoE layer)")
        self.moe_layers = tuple(layers)

    def _check_experts_per_layer(self) -> None:
        counts = self.experts_per_layer
        if counts is None:
            return
        n = self.num_moe_layers
        require(
            isinstance(counts, (tuple, list))
            and len(counts) == n
            and all(_is_int(c) and c >= 1 for c in counts),
            "experts_per_layer",
            f"must be None or {n} ints >= 1 (one per MoE layer), got {counts!r}",
        )
        self.experts_per_layer = tuple(counts)
        for j, i in enumerate(i for i in range(self.n_layers) if self.is_moe_layer(i)):
            try:
                self.moe_config(i)
            except ValueError as e:
                raise ValueError(f"experts_per_layer[{j}] (layer {i}): {e}") from None

    # ------------------------------------------------------------------ helpers
    def is_moe_layer(self, i: int) -> bool:
        """True when layer ``i`` (0-based) is an MoE layer."""
        if self.moe_layers is not None:
            return self.moe is not None and i in self.moe_layers
        return (
            self.moe is not None
            and i >= self.first_dense_layers
            and (i + 1) % self.moe_layer_step == 0
        )

    @property
    def mask_token_id(self) -> int | None:
        """The mask token of a block-diffusion model (the last id), None for a causal LM."""
        return self.vocab_size - 1 if self.objective == "block_diffusion" else None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def moe_config(self, i: int) -> MoEConfig:
        """The MoE config of layer ``i`` (0-based over all layers): ``moe`` itself, or with
        ``experts_per_layer`` its router's ``num_experts`` replaced by the layer's count and
        ``top_k`` clamped to it.

        Raises:
            ValueError: layer ``i`` is not an MoE layer.
        """
        if not self.is_moe_layer(i) or self.moe is None:
            raise InvalidValueError(f"layer {i}: not an MoE layer")
        if self.experts_per_layer is None:
            return self.moe
        j = sum(self.is_moe_layer(m) for m in range(i))  # ordinal among MoE layers (interleaving)
        E = self.experts_per_layer[j]
        router = self.moe.router
        if router.num_experts == E:
            return self.moe
        router = dataclasses.replace(router, num_experts=E, top_k=min(router.top_k, E))
        return dataclasses.replace(self.moe, router=router)

    @classmethod
    def tiny(
        cls,
        *,
        vocab_size: int = 64,
        d_model: int = 32,
        n_layers: int = 2,
        num_experts: int = 4,
        top_k: int = 2,
        ffn_hidden_size: int = 32,
        **overrides: Any,
    ) -> ModelConfig:
        """A small config for tests and examples (``moe.experts.hidden_size`` = ``d_model``)."""
        overrides.setdefault("n_heads", 4)
        overrides.setdefault("max_seq_len", 64)
        moe = overrides.pop("moe", None) or MoEConfig(
            router=RouterConfig(num_experts=num_experts, top_k=top_k),
            experts=ExpertsConfig(hidden_size=d_model, ffn_hidden_size=ffn_hidden_size),
        )
        return cls(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, moe=moe, **overrides)

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (nested configs become nested dicts; ``moe`` may be None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them."""
        return _from_dict(cls, d, "")


def _from_dict(cls: type, d: Any, where: str) -> Any:
    """Build dataclass ``cls`` from dict ``d``, recursing into dataclass-typed fields."""
    label = where or cls.__name__
    if not isinstance(d, dict):
        raise InvalidValueError(
            f"{label}: expected a dict for {cls.__name__}, got {type(d).__name__}"
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(d) - names)
    if unknown:
        raise InvalidValueError(f"{label}: unknown field(s) {unknown} for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        sub = _dataclass_in(hints[key])
        path = f"{where}.{key}" if where else key
        if sub is not None and value is not None:
            kwargs[key] = _from_dict(sub, value, path)
        elif isinstance(value, list):
            kwargs[key] = tuple(value) if _wants_tuple(hints[key]) else value
        else:
            kwargs[key] = value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass type in ``hint`` (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def _wants_tuple(hint: Any) -> bool:
    if typing.get_origin(hint) is tuple:
        return True
    return any(typing.get_origin(a) is tuple for a in typing.get_args(hint))
