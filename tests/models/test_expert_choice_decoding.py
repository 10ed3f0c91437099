"""Expert-choice models refuse KV-cache decoding: one token at a time every expert would take
it (capacity 1), a different model from the one trained."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import RouterConfig
from moelab.errors import UserError
from moelab.models import ModelConfig, MoETransformer
from moelab.serve.generate import generate_ids


def _ec_model():
    cfg = ModelConfig.tiny(vocab_size=40, n_layers=2, max_seq_len=32)
    cfg.moe.router = RouterConfig(num_experts=4, top_k=2, kind="expert_choice")
    torch.manual_seed(0)
    return MoETransformer(cfg).eval()


def test_kv_cache_decoding_is_refused_for_expert_choice():
    model = _ec_model()
    cache = model.new_kv_cache(1, 16)
    with pytest.raises(ValueError, match="expert choice") as info:
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    assert isinstance(info.value, UserError)  # the CLI shows it as one line
    with pytest.raises(ValueError, match="capacity of 1"):
        list(generate_ids(model, [3, 5, 7], max_new_tokens=2))
    # full-sequence scoring still works
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 40)
