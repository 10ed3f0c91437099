"""DeepSeek-V3 MoE blocks ↔ :class:`moelab.core.layer.MoELayer`.

Only the feed-forward MoE block is converted (moelab has no multi-head latent attention).
Facts from transformers 5.24 ``models/deepseek_v3/modeling_deepseek_v3.py`` and
``configuration_deepseek_v3.py``:

- ``DeepseekV3TopkRouter``: fp32 ``logits = x·Wᵀ`` (``gate.weight [E, D]``),
  ``scores = sigmoid(logits)``; selection on ``scores + e_score_correction_bias`` (a float32
  buffer ``[E]`` → moelab's ``router.expert_bias``), group-limited: groups scored by the sum
  of their top-2, best ``topk_group`` of ``n_group`` kept, others masked with -inf; weights are
  the unbiased scores of the chosen experts, divided by their sum (+1e-20) when
  ``norm_topk_prob``, times ``routed_scaling_factor``.
- ``DeepseekV3Experts``: fused ``experts.gate_up_proj [E, 2F, D]``/``experts.down_proj
  [E, D, F]`` with ``F = moe_intermediate_size`` (per-expert ``experts.M.{gate,up,down}_proj``
  on the Hub; ``conversion_mapping.py`` maps deepseek_v3 like qwen2_moe).
- ``DeepseekV3MoE``: plus ``shared_experts``, one SwiGLU MLP of width
  ``moe_intermediate_size · n_shared_experts``, ungated.
- Layers ``i >= first_k_dense_replace`` are MoE (moelab's ``first_dense_layers``).

The original DeepSeek config's ``scoring_func`` / ``topk_method``, when present, must be
``"sigmoid"`` / ``"noaux_tc"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.interop.errors import InteropError, UnsupportedConfigError
from moelab.interop.hf_weights import (
    Dims,
    apply_export,
    apply_import,
    detect_layout,
    moe_block_rules,
)


def _get(hf: Mapping[str, Any], name: str) -> Any:
    v = hf.get(name)
    if v is None:
        raise InteropError(f"config: required field {name!r} is missing")
    return v


def moe_config_from_deepseek_v3(hf: Mapping[str, Any]) -> MoEConfig:
    """The :class:`MoEConfig` of a DeepSeek-V3 config dict's MoE blocks.

    Raises:
        UnsupportedConfigError: ``scoring_func``/``topk_method``/``hidden_act`` other than
            DeepSeek-V3's, naming the field.
    """
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedConfigError(f"scoring_func: must be 'sigmoid', got {hf['scoring_func']!r}")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedConfigError(f"topk_method: must be 'noaux_tc', got {hf['topk_method']!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act: must be 'silu', got {hf['hidden_act']!r}")
    D, F = int(_get(hf, "hidden_size")), int(_get(hf, "moe_intermediate_size"))
    n_shared = int(hf.get("n_shared_experts") or 0)
    E = int(_get(hf, "n_routed_experts"))
    G, g = _get(hf, "n_group"), _get(hf, "topk_group")
    if E % G or E // G < 2:
        raise UnsupportedConfigError(
            f"n_group: DeepSeek-V3 scores each group by its top-2 experts, so n_group={G} must "
            f"divide n_routed_experts={E} into groups of at least 2"
        )
    return MoEConfig(
        router=RouterConfig(
            num_experts=E,
            top_k=int(_get(hf, "num_experts_per_tok")),
            score_func="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            n_group=int(G),
            topk_group=int(g),
            expert_bias=True,
        ),
        experts=ExpertsConfig(
            hidden_size=D,
            ffn_hidden_size=F,
            shared_expert_size=F * n_shared,
            shared_expert_gate=False,
            init_std=float(hf.get("initializer_range", 0.02)),
        ),
        losses=LossConfig(load_balance="none", aux_loss_coeff=0.0, z_loss_coeff=0.0),
    )


def _dims(moe: MoEConfig) -> Dims:
    D, F = moe.experts.hidden_size, moe.experts.ffn_hidden_size
    shared = moe.experts.shared_expert_size
    return Dims(
        vocab=("vocab_size", 0),
        hidden=("hidden_size", D),
        q=("", 0),
        kv=("", 0),
        head=("", 0),
        experts=("n_routed_experts", moe.router.num_experts),
        expert_ffn=("moe_intermediate_size", F),
        shared_ffn=("moe_intermediate_size*n_shared_experts", shared) if shared else None,
    )


def import_deepseek_v3_moe(
    tensors: Mapping[str, Tensor], hf_config: Mapping[str, Any], prefix: str = ""
) -> MoELayer:
    """Build an :class:`MoELayer` from one DeepSeek-V3 MoE block's tensors.

    Args:
        tensors: the block's tensors (a ``DeepseekV3MoE.state_dict()``, or a checkpoint's
            tensors whose names start with ``prefix``, e.g. ``"model.layers.3.mlp."``). Names
            outside ``prefix`` are ignored; every name under it must be used.
        hf_config: the DeepSeek-V3 config dict (``DeepseekV3Config.to_dict()`` or config.json).
    Returns:
        The layer (eval mode, dtype of ``experts``' weights).
    Raises:
        MissingTensorError, UnexpectedTensorError, TensorShapeError, UnsupportedConfigError.
    """
    moe = moe_config_from_deepseek_v3(hf_config)
    own = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    layout = detect_layout(own)
    rules = moe_block_rules(prefix, "", _dims(moe), layout, arch="deepseek_v3", expert_bias=True)
    state = apply_import(rules, own, where=f"DeepSeek-V3 MoE block {prefix!r}")
    layer = MoELayer(moe).to(state["experts.w_gate_up"].dtype)
    layer.router.expert_bias = torch.zeros(moe.router.num_experts)  # fp32, as HF keeps it
    layer.load_state_dict(state, strict=True)
    return layer.eval()


def export_deepseek_v3_moe(
    layer: MoELayer, prefix: str = "", layout: str = "fused"
) -> dict[str, Tensor]:
    """The DeepSeek-V3 tensors of ``layer`` (inverse of :func:`import_deepseek_v3_moe`).

    Raises:
        UnsupportedConfigError: the layer's config is not DeepSeek-V3-shaped (naming the
            field: sigmoid scores, group limits, expert bias, ungated shared expert).
    """
    cfg = layer.config
    r, ex = cfg.router, cfg.experts
    checks = [
        (r.kind == "token_choice", "moe.router.kind", "token_choice"),
        (r.score_func == "sigmoid", "moe.router.score_func", "sigmoid"),
        (r.n_group is not None, "moe.router.n_group", "set (group-limited routing)"),
        (r.expert_bias, "moe.router.expert_bias", "True (e_score_correction_bias)"),
        (r.capacity_factor is None, "moe.router.capacity_factor", "None (dropless)"),
        (ex.activation == "swiglu", "moe.experts.activation", "swiglu"),
        (not ex.shared_expert_gate, "moe.experts.shared_expert_gate", "False"),
        (
            ex.shared_expert_size % ex.ffn_hidden_size == 0,
            "moe.experts.shared_expert_size",
            "a multiple of ffn_hidden_size (n_shared_experts · moe_intermediate_size)",
        ),
    ]
    for ok, name, want in checks:
        if not ok:
            raise UnsupportedConfigError(f"{name}: DeepSeek-V3 needs {want}")
    rules = moe_block_rules(prefix, "", _dims(cfg), layout, arch="deepseek_v3", expert_bias=True)
    return apply_export(rules, layer.state_dict())


def deepseek_v3_config_fields(layer: MoELayer) -> dict[str, Any]:
    """The DeepSeek-V3 config fields that describe ``layer``'s MoE block."""
    r, ex = layer.config.router, layer.config.experts
    return {
        "hidden_size": ex.hidden_size,
        "moe_intermediate_size": ex.ffn_hidden_size,
        "n_routed_experts": r.num_experts,
        "n_shared_experts": ex.shared_expert_size // ex.ffn_hidden_size,
        "num_experts_per_tok": r.top_k,
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "norm_topk_prob": r.norm_topk_prob,
        "routed_scaling_factor": r.routed_scaling_factor,
    }
