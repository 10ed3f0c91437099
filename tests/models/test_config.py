from __future__ import annotations

import dataclasses
import json

import pytest

from moelab.core.config import MoEConfig, RouterConfig
from moelab.models import ModelConfig, default_dense_ffn_size


def test_derived_defaults(cfg_factory):
    cfg = cfg_factory(d_model=48, n_heads=6, dense_ffn_size=None)
    assert cfg.head_dim == 8
    assert cfg.n_kv_heads == 6
    assert cfg.dense_ffn_size == default_dense_ffn_size(48) == 128
    assert [cfg.is_moe_layer(i) for i in range(cfg.n_layers)] == [True, True]
    cfg2 = cfg_factory(first_dense_layers=1)
    assert [cfg2.is_moe_layer(i) for i in range(2)] == [False, True]
    assert cfg2.num_moe_layers == 1
    assert cfg_factory(dense=True).num_moe_layers == 0


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": -1}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"n_heads": 3, "n_kv_heads": None, "head_dim": None}, "head_dim"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_kv_heads": 8}, "n_kv_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"first_dense_layers": 3}, "first_dense_layers"),
        ({"first_dense_layers": -1}, "first_dense_layers"),
        ({"dense_ffn_size": 0}, "dense_ffn_size"),
        ({"init_std": 0.0}, "init_std"),
        ({"d_model": 64}, "moe.experts.hidden_size"),
    ],
)
def test_validation_names_field(cfg_factory, override, field):
    cfg = cfg_factory()
    with pytest.raises(ValueError, match=rf"^{field}:"):
        dataclasses.replace(cfg, **override)


def test_moe_must_be_moeconfig():
    with pytest.raises(ValueError, match=r"^moe:"):
        ModelConfig(moe={"router": {}})


def test_dict_round_trip_through_json(cfg_factory):
    cfg = cfg_factory(n_kv_heads=2, tie_embeddings=True, first_dense_layers=1, shared_expert_size=8)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["moe"]["router"]["num_experts"] == 4
    back = ModelConfig.from_dict(d)
    assert back == cfg
    assert isinstance(back.moe, MoEConfig) and isinstance(back.moe.router, RouterConfig)
    dense = cfg_factory(dense=True)
    assert ModelConfig.from_dict(json.loads(json.dumps(dense.to_dict()))) == dense


def test_from_dict_rejects_unknown_and_invalid(cfg_factory):
    d = cfg_factory().to_dict()
    d["n_layerz"] = 3
    with pytest.raises(ValueError, match="n_layerz"):
        ModelConfig.from_dict(d)
    d = cfg_factory().to_dict()
    d["moe"]["router"]["topk"] = 2
    with pytest.raises(ValueError, match=r"moe\.router.*topk"):
        ModelConfig.from_dict(d)
    d = cfg_factory().to_dict()
    d["moe"]["router"]["top_k"] = 9
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.from_dict(d)


def test_tiny_helper_builds_a_consistent_config():
    cfg = ModelConfig.tiny(d_model=24, n_heads=3, num_experts=6, top_k=3)
    assert cfg.moe.experts.hidden_size == 24 and cfg.head_dim == 8
    assert (cfg.moe.router.num_experts, cfg.moe.router.top_k) == (6, 3)
