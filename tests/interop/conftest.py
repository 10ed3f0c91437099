"""Tiny random Hugging Face MoE models built with transformers itself."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
)


def hf_config(arch: str, **over):
    """A tiny transformers config of ``arch`` (plus overrides)."""
    t = transformers
    if arch == "mixtral":
        kw = dict(COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = t.MixtralConfig
    elif arch == "qwen2_moe":
        kw = dict(
            COMMON,
            num_hidden_layers=3,
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=36,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        )
        cls = t.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        kw = dict(
            COMMON,
            head_dim=16,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        )
        cls = t.Qwen3MoeConfig
    elif arch == "olmoe":
        kw = dict(COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=3)
        kw.update(pad_token_id=0, eos_token_id=1)
        cls = t.OlmoeConfig
    else:
        raise AssertionError(arch)
    kw.update(over)
    return cls(**kw)


@torch.no_grad()
def randomise(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter and buffer random and O(0.1–1), so each one visibly moves outputs."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif p.dim() == 1:
            p.copy_(0.2 * noise)
        else:
            p.copy_(noise * (0.6 / p.shape[-1] ** 0.5))
    return module


def hf_model(arch: str, seed: int = 0, **over):
    """An eval-mode random transformers CausalLM of ``arch``."""
    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return randomise(model, seed).eval()


def save_hf(model, folder, layout: str):
    """``save_pretrained`` in the per-expert (Hub) or fused (v5) layout."""
    model.save_pretrained(folder, save_original_format=(layout == "per_expert"))
    return folder


class _HF:
    """Helpers handed to tests through the ``hf`` fixture."""

    transformers = transformers
    config = staticmethod(hf_config)
    model = staticmethod(hf_model)
    save = staticmethod(save_hf)
    randomise = staticmethod(randomise)


@pytest.fixture
def hf() -> type[_HF]:
    return _HF
