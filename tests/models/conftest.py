from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig, MoETransformer


def make_cfg(*, dense: bool = False, **kw) -> ModelConfig:
    """A tiny config; init_std 0.1 so that every component visibly moves the logits."""
    d = kw.pop("d_model", 32)
    E, k, F = kw.pop("num_experts", 4), kw.pop("top_k", 2), kw.pop("ffn", 16)
    shared = kw.pop("shared_expert_size", 0)
    moe = (
        None
        if dense
        else MoEConfig(
            router=RouterConfig(num_experts=E, top_k=k),
            experts=ExpertsConfig(hidden_size=d, ffn_hidden_size=F, shared_expert_size=shared),
            losses=LossConfig(),
        )
    )
    base = dict(
        vocab_size=61,
        d_model=d,
        n_layers=2,
        n_heads=4,
        max_seq_len=48,
        init_std=0.1,
        dense_ffn_size=40,
        moe=moe,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def cfg_factory():
    return make_cfg


@pytest.fixture
def model_factory():
    def build(seed: int = 0, **kw) -> MoETransformer:
        torch.manual_seed(seed)
        return MoETransformer(make_cfg(**kw)).eval()

    return build
