from __future__ import annotations

import pytest
import torch

from moelab.models import (
    MoETransformer,
    count_params,
    dense_twin_config,
    moe_layer_params,
)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=1, num_experts=8),
        dict(shared_expert_size=24, n_kv_heads=2),
        dict(first_dense_layers=1, n_layers=3),
        dict(tie_embeddings=True, num_experts=16, top_k=4, ffn=8),
    ],
)
def test_twin_matches_active_params_within_5_percent(cfg_factory, kw):
    cfg = cfg_factory(**kw)
    twin_cfg = dense_twin_config(cfg)
    assert twin_cfg.moe is None and twin_cfg.num_moe_layers == 0
    for f in (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "tie_embeddings",
        "max_seq_len",
    ):
        assert getattr(twin_cfg, f) == getattr(cfg, f)
    moe, twin = MoETransformer(cfg), MoETransformer(twin_cfg)
    cm, ct = count_params(moe), count_params(twin)
    assert ct["total"] == ct["active_per_token"]
    assert cm["active_per_token"] < cm["total"]
    assert abs(ct["active_per_token"] - cm["active_per_token"]) <= 0.05 * cm["active_per_token"]
    # the FFN part alone also matches (excluding embeddings, which are identical)
    assert abs(ct["active_non_embedding"] - cm["active_non_embedding"]) <= (
        0.05 * cm["active_non_embedding"]
    )
    assert twin(torch.randint(0, 61, (1, 4))).records == [None] * cfg.n_layers


def test_twin_width_rule(cfg_factory):
    # swiglu, no shared expert: F_twin = round(k·F + E/3)
    cfg = cfg_factory(num_experts=6, top_k=2, ffn=16, d_model=32)
    assert dense_twin_config(cfg).dense_ffn_size == 2 * 16 + 2
    # shared expert of width 24 adds 24
    cfg = cfg_factory(num_experts=6, top_k=2, ffn=16, shared_expert_size=24)
    assert dense_twin_config(cfg).dense_ffn_size == 2 * 16 + 24 + 2


def test_count_params_by_hand(cfg_factory):
    cfg = cfg_factory(num_experts=4, top_k=1, ffn=16, n_layers=1, n_kv_heads=2)
    D, V, E, F, hd = 32, 61, 4, 16, 8
    attn = D * 4 * hd * 2 + D * 2 * hd * 2
    norms = 3 * D
    expert = 3 * D * F
    router = E * D
    total = 2 * V * D + attn + norms + router + E * expert
    c = count_params(MoETransformer(cfg))
    assert c["total"] == total
    assert c["active_per_token"] == total - (E - 1) * expert
    assert c["embedding"] == 2 * V * D
    lp = moe_layer_params(cfg.moe)
    assert lp == {
        "total": router + E * expert,
        "active_per_token": router + expert,
        "routed_expert": E * expert,
    }


def test_twin_of_dense_config_is_identity(cfg_factory):
    dense = cfg_factory(dense=True)
    assert dense_twin_config(dense) == dense
