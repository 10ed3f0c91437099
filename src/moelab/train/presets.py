"""The default model of ``moelab train``: sized to learn visibly in ~10 minutes on 2 CPU cores."""

from __future__ import annotations

from typing import Any

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig


def default_model_config() -> ModelConfig:
    """4 layers, D=192, 8 experts of width 384, top-2, byte vocabulary, context 256."""
    d_model = 192
    return ModelConfig(
        vocab_size=256,
        d_model=d_model,
        n_layers=4,
        n_heads=6,
        n_kv_heads=2,
        max_seq_len=256,
        moe=MoEConfig(
            router=RouterConfig(num_experts=8, top_k=2),
            experts=ExpertsConfig(hidden_size=d_model, ffn_hidden_size=384),
            losses=LossConfig(load_balance="switch", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
        ),
    )


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: ``override``'s leaves win; None values in override are skipped."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
