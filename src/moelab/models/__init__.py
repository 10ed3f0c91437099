"""Decoder-only MoE transformer LM, its dense twin, model-folder save/load, and the BERT
text encoder."""

from moelab.models.attention import Attention, KVCache, causal_mask
from moelab.models.block import DecoderBlock
from moelab.models.config import ModelConfig, default_dense_ffn_size
from moelab.models.dense_twin import count_params, dense_twin_config, moe_layer_params
from moelab.models.encoder import BertEncoder, cls_pool, mean_pool, pool
from moelab.models.encoder_config import BertConfig
from moelab.models.expert_growth import consolidate_model_experts
from moelab.models.ffn import SwiGLUFFN
from moelab.models.io import (
    FORMAT_VERSION,
    CheckpointError,
    load_config,
    load_model,
    save_model,
    verify_folder,
)
from moelab.models.norm import RMSNorm
from moelab.models.rope import RotaryEmbedding, apply_rope, rope_cos_sin, rotate_half
from moelab.models.swap_router import with_router
from moelab.models.transformer import LMLoss, LMOutput, MoETransformer

__all__ = [
    "FORMAT_VERSION",
    "Attention",
    "BertConfig",
    "BertEncoder",
    "CheckpointError",
    "DecoderBlock",
    "KVCache",
    "LMLoss",
    "LMOutput",
    "MoETransformer",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUFFN",
    "apply_rope",
    "causal_mask",
    "cls_pool",
    "consolidate_model_experts",
    "count_params",
    "default_dense_ffn_size",
    "dense_twin_config",
    "load_config",
    "load_model",
    "mean_pool",
    "moe_layer_params",
    "pool",
    "rope_cos_sin",
    "rotate_half",
    "save_model",
    "verify_folder",
    "with_router",
]
