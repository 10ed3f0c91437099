"""Expert-choice models refuse KV-cache decoding (one token at a time every expert would
take it) and generate by recomputing the prefix instead."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import RouterConfig
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
    with pytest.raises(ValueError, match="expert choice"):
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    assert model.needs_full_prefix()


def test_expert_choice_generation_recomputes_the_prefix():
    model = _ec_model()
    prompt = [3, 5, 7]
    got = list(generate_ids(model, list(prompt), max_new_tokens=4, temperature=0.0, top_k=1))
    ids = list(prompt)
    for _ in range(4):  # greedy reference: full forward over the whole prefix each step
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]
