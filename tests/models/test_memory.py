import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig, MoETransformer
from moelab.models.memory import ModelTooLargeError, check_model_fits, estimate_parameters


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig.tiny(),
        ModelConfig.tiny(
            tie_embeddings=True, attention_bias=True, qk_norm="head", first_dense_layers=1
        ),
        ModelConfig.tiny(
            qk_norm="full",
            moe=MoEConfig(
                router=RouterConfig(num_experts=3, top_k=1),
                experts=ExpertsConfig(
                    hidden_size=32,
                    ffn_hidden_size=16,
                    activation="gelu",
                    shared_expert_size=24,
                    shared_expert_gate=True,
                ),
            ),
        ),
        ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, moe=None),
        ModelConfig.tiny(
            moe=MoEConfig(
                router=RouterConfig(num_experts=3, top_k=1),
                experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=16, activation="geglu"),
            ),
        ),
    ],
)
def test_estimate_is_exact(cfg):
    model = MoETransformer(cfg)
    assert estimate_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_huge_config_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr("moelab.models.memory.available_memory_bytes", lambda: 10**9)
    cfg = ModelConfig.tiny(num_experts=10**6, top_k=1)
    with pytest.raises(ModelTooLargeError, match=r"mostly experts: num_experts=1000000"):
        MoETransformer(cfg)
    monkeypatch.setenv("MOELAB_ALLOW_LARGE_MODEL", "1")
    check_model_fits(cfg)  # the override skips the check
    with torch.device("meta"):
        MoETransformer(cfg)  # meta models are never checked
