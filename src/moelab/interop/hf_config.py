"""Hugging Face ``config.json`` ↔ :class:`moelab.models.ModelConfig` for Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE.

Field names, defaults and semantics were read from transformers 5.24:

- ``models/mixtral/configuration_mixtral.py`` / ``modeling_mixtral.py``: ``num_local_experts``,
  ``intermediate_size`` is the expert width, the router always renormalises its top-k softmax
  weights (``MixtralTopKRouter``), ``sliding_window`` (None = full attention), rope theta
  default 1e6.
- ``models/qwen2_moe/…``: ``num_experts``, ``moe_intermediate_size`` (experts),
  ``intermediate_size`` (dense MLP of ``mlp_only_layers``), ``shared_expert_intermediate_size``
  with a sigmoid ``shared_expert_gate``, ``qkv_bias`` (q/k/v biases, o without), softmax →
  top-k → optional ``norm_topk_prob``, MoE on layer i iff ``i not in mlp_only_layers and
  (i+1) % decoder_sparse_step == 0``, ``use_sliding_window``/``layer_types``.
- ``models/qwen3_moe/…``: as Qwen2-MoE without shared expert; ``q_norm``/``k_norm`` RMSNorm
  over ``head_dim`` (``Qwen3MoeAttention``); ``attention_bias`` would also bias ``o_proj``.
  Saved configs may spell the expert count ``num_local_experts`` (attribute map).
- ``models/olmoe/…``: ``num_experts``, ``intermediate_size`` is the expert width,
  ``q_norm [hidden_size]``/``k_norm [hidden_size/heads·kv_heads]`` over the whole projection
  (``OlmoeAttention``), ``clip_qkv``.
- ``modeling_rope_utils.py``: v5 stores ``rope_parameters = {"rope_type", "rope_theta"}``;
  older files have top-level ``rope_theta``/``rope_scaling``.

Only ``rope_type == "default"``, ``hidden_act == "silu"`` and full (non-sliding) attention are
supported; anything else raises :class:`UnsupportedConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.interop.errors import InteropError, UnsupportedConfigError
from moelab.models.config import ModelConfig


@dataclass(frozen=True)
class ArchSpec:
    """Static facts about one Hugging Face architecture.

    Attributes:
        name: the ``model_type``.
        architecture: the ``architectures[0]`` class name.
        num_experts_field: config field of E.
        expert_size_field: config field of each routed expert's width F.
        rope_theta: transformers' default θ when the config omits it.
        rms_norm_eps: transformers' default ε.
        qk_norm: moelab's ``qk_norm`` for this architecture.
        shared_expert: has a (gated) shared expert (Qwen2-MoE).
    """

    name: str
    architecture: str
    num_experts_field: str
    expert_size_field: str
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qk_norm: str = "none"
    shared_expert: bool = False


ARCHS: dict[str, ArchSpec] = {
    "mixtral": ArchSpec(
        "mixtral", "MixtralForCausalLM", "num_local_experts", "intermediate_size", 1e6, 1e-5, 131072
    ),
    "qwen2_moe": ArchSpec(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "num_experts",
        "moe_intermediate_size",
        1e4,
        1e-6,
        32768,
        shared_expert=True,
    ),
    "qwen3_moe": ArchSpec(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "num_experts",
        "moe_intermediate_size",
        1e4,
        1e-6,
        32768,
        qk_norm="head",
    ),
    "olmoe": ArchSpec(
        "olmoe", "OlmoeForCausalLM", "num_experts", "intermediate_size", 1e4, 1e-5, 4096, "full"
    ),
}


def arch_of(hf: dict[str, Any]) -> ArchSpec:
    """The :class:`ArchSpec` of a config dict (from ``model_type``).

    Raises:
        UnsupportedConfigError: unknown ``model_type`` (DeepSeek-V3 names its MoE-block API).
    """
    mt = hf.get("model_type")
    if mt == "deepseek_v3":
        raise UnsupportedConfigError(
            "model_type: deepseek_v3 uses multi-head latent attention (q_lora_rank, "
            "kv_lora_rank), which moelab does not implement; convert its MoE blocks with "
            "moelab.interop.import_deepseek_v3_moe"
        )
    if mt not in ARCHS:
        raise UnsupportedConfigError(
            f"model_type: {mt!r} is not supported (supported: {sorted(ARCHS)})"
        )
    return ARCHS[mt]


def _need(hf: dict[str, Any], name: str) -> Any:
    if hf.get(name) is None:
        raise InteropError(f"config.json: required field {name!r} is missing")
    return hf[name]


def _int(hf: dict[str, Any], name: str, default: Any = None) -> int:
    v = hf.get(name, default) if default is not None else _need(hf, name)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool):
        raise InteropError(f"{name}: expected an integer, got {v!r}")
    return v


def num_experts(hf: dict[str, Any], spec: ArchSpec) -> int:
    """E, accepting Qwen3-MoE's alias ``num_local_experts`` for ``num_experts``."""
    names = [spec.num_experts_field]
    if spec.name == "qwen3_moe":
        names.append("num_local_experts")
    values = {n: hf[n] for n in names if hf.get(n) is not None}
    if not values:
        raise InteropError(f"config.json: required field {spec.num_experts_field!r} is missing")
    if len(set(values.values())) > 1:
        raise InteropError(f"{' / '.join(values)}: disagree ({values})")
    return _int(values, next(iter(values)))


def rope_theta(hf: dict[str, Any], spec: ArchSpec) -> float:
    """θ from ``rope_parameters`` (v5) or ``rope_theta`` (v4); rejects scaled RoPE."""
    rp = hf.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict):
            raise UnsupportedConfigError(f"rope_parameters: expected a dict, got {rp!r}")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype != "default":
            raise UnsupportedConfigError(
                f"rope_parameters.rope_type: only 'default' RoPE is supported, got {rtype!r}"
            )
        extra = sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise UnsupportedConfigError(f"rope_parameters: unsupported entries {extra}")
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedConfigError(
                "rope_parameters.partial_rotary_factor: only 1.0 (full rotary) is supported"
            )
        theta = rp.get("rope_theta", hf.get("rope_theta", spec.rope_theta))
    else:
        if hf.get("rope_scaling") is not None:
            raise UnsupportedConfigError(
                f"rope_scaling: scaled RoPE is not supported, got {hf['rope_scaling']!r}"
            )
        theta = hf.get("rope_theta", spec.rope_theta)
    return float(theta)


def _check_unsupported(hf: dict[str, Any], spec: ArchSpec) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {act!r}")
    if spec.name == "mixtral" and hf.get("sliding_window") is not None:
        raise UnsupportedConfigError(
            f"sliding_window: sliding-window attention is not supported, got "
            f"{hf['sliding_window']!r} (use null)"
        )
    if spec.name in ("qwen2_moe", "qwen3_moe"):
        if hf.get("use_sliding_window", False):
            raise UnsupportedConfigError(
                "use_sliding_window: sliding-window attention is not supported"
            )
        lt = hf.get("layer_types")
        if lt is not None and any(t != "full_attention" for t in lt):
            raise UnsupportedConfigError(
                f"layer_types: only 'full_attention' layers are supported, got {lt!r}"
            )
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise UnsupportedConfigError(f"decoder_sparse_step: must be an int >= 1, got {step!r}")
    if spec.name in ("qwen3_moe", "olmoe") and hf.get("attention_bias", False):
        raise UnsupportedConfigError(
            f"attention_bias: {spec.name} would bias o_proj too, which moelab's attention "
            "does not have; only false is supported"
        )
    if spec.name == "olmoe" and hf.get("clip_qkv") is not None:
        raise UnsupportedConfigError(f"clip_qkv: must be null, got {hf['clip_qkv']!r}")


def _dense_placement(
    hf: dict[str, Any], n_layers: int, step: int
) -> tuple[int, tuple[int, ...] | None]:
    """``(first_dense_layers, moe_layers)`` of a Qwen2/3-MoE config: its ``mlp_only_layers``
    as a prefix when they are one (the rule every Qwen release uses), else an explicit
    placement (layer i is MoE iff i is not MLP-only and ``(i + 1) % step == 0``)."""
    mlp_only = list(hf.get("mlp_only_layers") or [])
    if any(
        not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_layers for i in mlp_only
    ):
        raise UnsupportedConfigError(
            f"mlp_only_layers: entries must be layer indices in [0, {n_layers}), got {mlp_only!r}"
        )
    if sorted(mlp_only) == list(range(len(mlp_only))):
        return len(mlp_only), None
    dense = set(mlp_only)
    return 0, tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def config_from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, ArchSpec]:
    """Map a Hugging Face config dict to a :class:`ModelConfig`.

    Router: softmax over all experts, then top-k (``softmax_before_topk``); Mixtral always
    renormalises the k weights, the others follow ``norm_topk_prob``. Losses: transformers'
    ``load_balancing_loss_func`` convention with ``router_aux_loss_coef`` and no z-loss.

    Raises:
        UnsupportedConfigError / InteropError: naming the field.
    """
    spec = arch_of(hf)
    _check_unsupported(hf, spec)
    D = _int(hf, "hidden_size")
    H = _int(hf, "num_attention_heads")
    L = _int(hf, "num_hidden_layers")
    kv = hf.get("num_key_value_heads") or H
    head_dim = hf.get("head_dim") or D // H
    if spec.name == "olmoe" and head_dim * H != D:
        raise UnsupportedConfigError(
            f"head_dim: OLMoE's q_norm spans hidden_size={D}, so head_dim must be "
            f"hidden_size/num_attention_heads={D // H}, got {head_dim}"
        )
    E = num_experts(hf, spec)
    k = _int(hf, "num_experts_per_tok")
    F = _int(hf, spec.expert_size_field)
    norm_topk = True if spec.name == "mixtral" else bool(hf.get("norm_topk_prob", False))
    shared = _int(hf, "shared_expert_intermediate_size") if spec.shared_expert else 0
    if spec.shared_expert and shared < 1:
        raise UnsupportedConfigError(
            f"shared_expert_intermediate_size: must be >= 1 for qwen2_moe, got {shared}"
        )
    first_dense, moe_layers, step = 0, None, 1
    dense_ffn = None
    if spec.name in ("qwen2_moe", "qwen3_moe"):
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        first_dense, moe_layers = _dense_placement(hf, L, step)
        dense_ffn = hf.get("intermediate_size")
    jitter = float(hf.get("router_jitter_noise", 0.0) or 0.0)
    moe = MoEConfig(
        router=RouterConfig(
            num_experts=E,
            top_k=k,
            score_func="softmax",
            softmax_before_topk=True,
            norm_topk_prob=norm_topk,
            jitter_eps=jitter,
            # transformers' Mixtral multiplies the hidden states (router and experts' input)
            jitter_experts=spec.name == "mixtral" and jitter > 0,
        ),
        experts=ExpertsConfig(
            hidden_size=D,
            ffn_hidden_size=F,
            shared_expert_size=shared,
            shared_expert_gate=spec.shared_expert,
            init_std=float(hf.get("initializer_range", 0.02)),
        ),
        losses=LossConfig(
            load_balance="switch",
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0) or 0.0),
            z_loss_coeff=0.0,
            convention="hf",
        ),
    )
    cfg = ModelConfig(
        vocab_size=_int(hf, "vocab_size"),
        d_model=D,
        n_layers=L,
        n_heads=H,
        n_kv_heads=kv,
        head_dim=head_dim,
        max_seq_len=_int(hf, "max_position_embeddings", spec.max_position_embeddings),
        rope_theta=rope_theta(hf, spec),
        norm_eps=float(hf.get("rms_norm_eps", spec.rms_norm_eps)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("qkv_bias", True)) if spec.name == "qwen2_moe" else False,
        qk_norm=spec.qk_norm,
        first_dense_layers=first_dense,
        moe_layer_step=step if moe_layers is None else 1,
        moe_layers=moe_layers,
        dense_ffn_size=dense_ffn,
        init_std=float(hf.get("initializer_range", 0.02)),
        moe=moe,
    )
    return cfg, spec


def infer_arch(cfg: ModelConfig) -> str:
    """The HF architecture a moelab config most naturally exports to."""
    if cfg.qk_norm == "head":
        return "qwen3_moe"
    if cfg.qk_norm == "full":
        return "olmoe"
    if cfg.attention_bias or (cfg.moe is not None and cfg.moe.experts.shared_expert_size):
        return "qwen2_moe"
    return "mixtral"


def _require(cond: bool, field: str, arch: str, msg: str) -> None:
    if not cond:
        raise UnsupportedConfigError(f"{field}: {arch} {msg}")


def config_to_hf(cfg: ModelConfig, arch: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` as architecture ``arch``.

    ``base`` (e.g. the config a model was imported from) supplies fields moelab does not
    model (token ids, …); every structural field is overwritten from ``cfg``.

    Raises:
        UnsupportedConfigError: ``cfg`` uses a feature ``arch`` cannot express, naming the
            moelab field (e.g. ``moe.router.score_func``).
    """
    if arch not in ARCHS:
        raise UnsupportedConfigError(f"arch: must be one of {sorted(ARCHS)}, got {arch!r}")
    spec = ARCHS[arch]
    _require(  # HF would load it as a causal LM: a checkpoint that loads and is wrong
        cfg.objective == "causal",
        "objective",
        arch,
        f"is a causal LM; a {cfg.objective} model has no Hugging Face architecture",
    )
    _require(cfg.latent_moe is None, "latent_moe", arch, "has no Multi-Head LatentMoE layers")
    moe = cfg.moe
    if moe is None:
        raise UnsupportedConfigError(f"moe: {arch} needs MoE layers (got a dense model)")
    moe_layer_ids = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    for j, n in enumerate(cfg.experts_per_layer or ()):
        _require(
            n == moe.router.num_experts,
            "experts_per_layer",
            arch,
            f"needs the same number of experts in every MoE layer; layer "
            f"{moe_layer_ids[j]} has {n}, not {moe.router.num_experts} (a pruned model "
            "with per-layer budgets; prune with --per-layer uniform to export it)",
        )
    r, ex = moe.router, moe.experts
    _require(r.kind == "token_choice", "moe.router.kind", arch, "needs token_choice routing")
    _require(r.score_func == "softmax", "moe.router.score_func", arch, "needs softmax scores")
    _require(r.softmax_before_topk, "moe.router.softmax_before_topk", arch, "needs True")
    _require(r.routed_scaling_factor == 1.0, "moe.router.routed_scaling_factor", arch, "needs 1")
    _require(r.n_group is None, "moe.router.n_group", arch, "has no group-limited routing")
    _require(not r.expert_bias, "moe.router.expert_bias", arch, "has no expert bias")
    _require(r.capacity_factor is None, "moe.router.capacity_factor", arch, "is dropless")
    _require(r.input_size is None, "moe.router.input_size", arch, "routes on the tokens")
    _require(r.logit_noise_std == 0, "moe.router.logit_noise_std", arch, "has no logit noise")
    _require(not r.force_uniform, "moe.router.force_uniform", arch, "routes on the router's scores")
    _require(ex.activation == "swiglu", "moe.experts.activation", arch, "needs swiglu")
    _require(not ex.bias, "moe.experts.bias", arch, "has no expert biases")
    _require(not ex.lora_rank, "moe.experts.lora_rank", arch, "has no adapters (merge them first)")
    if arch == "mixtral":
        _require(r.norm_topk_prob, "moe.router.norm_topk_prob", arch, "always renormalises")
    _require(
        cfg.qk_norm == spec.qk_norm, "qk_norm", arch, f"needs {spec.qk_norm!r}, got {cfg.qk_norm!r}"
    )
    _require(
        not cfg.attention_bias or arch == "qwen2_moe",
        "attention_bias",
        arch,
        "has no q/k/v-only biases (use qwen2_moe)",
    )
    if spec.shared_expert:
        _require(
            ex.shared_expert_size > 0 and ex.shared_expert_gate,
            "moe.experts.shared_expert_size",
            arch,
            "needs a gated shared expert (shared_expert_size > 0, shared_expert_gate)",
        )
    else:
        _require(ex.shared_expert_size == 0, "moe.experts.shared_expert_size", arch, "has none")
    if arch in ("mixtral", "olmoe"):
        _require(cfg.first_dense_layers == 0, "first_dense_layers", arch, "has no dense layers")
        _require(cfg.moe_layer_step == 1, "moe_layer_step", arch, "has no dense layers")
        _require(len(moe_layer_ids) == cfg.n_layers, "moe_layers", arch, "has no dense layers")
    if arch == "olmoe":
        _require(
            cfg.head_dim * cfg.n_heads == cfg.d_model,
            "head_dim",
            arch,
            "needs head_dim·n_heads == d_model (q_norm spans hidden_size)",
        )
    hf: dict[str, Any] = dict(base or {})
    for stale in ("rope_theta", "rope_scaling", "num_local_experts", "num_experts"):
        hf.pop(stale, None)
    hf.update(
        architectures=[spec.architecture],
        model_type=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        initializer_range=cfg.init_std,
        num_experts_per_tok=r.top_k,
        router_aux_loss_coef=moe.losses.aux_loss_coeff,
    )
    hf[spec.num_experts_field] = r.num_experts
    hf[spec.expert_size_field] = ex.ffn_hidden_size
    if arch == "mixtral":
        hf.update(sliding_window=None, router_jitter_noise=r.jitter_eps)
    else:
        hf["norm_topk_prob"] = r.norm_topk_prob
    if arch in ("qwen2_moe", "qwen3_moe"):
        hf.update(
            intermediate_size=cfg.dense_ffn_size,
            decoder_sparse_step=cfg.moe_layer_step,
            mlp_only_layers=(
                list(range(cfg.first_dense_layers))
                if cfg.moe_layers is None
                else [i for i in range(cfg.n_layers) if i not in cfg.moe_layers]
            ),
            use_sliding_window=False,
        )
        hf.pop("layer_types", None)
    if arch == "qwen2_moe":
        hf.update(
            shared_expert_intermediate_size=ex.shared_expert_size, qkv_bias=cfg.attention_bias
        )
    if arch in ("qwen3_moe", "olmoe"):
        hf["attention_bias"] = False
    if arch == "olmoe":
        hf["clip_qkv"] = None
    return hf
