"""Explicit per-layer MoE placement (``ModelConfig.moe_layers``) and block-output hooks."""

from __future__ import annotations

import pytest
import torch

from moelab.core.layer import MoELayer
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.dense_twin import dense_twin_config
from moelab.models.ffn import SwiGLUFFN
from moelab.models.hooks import observe_blocks
from moelab.train.upcycle import max_logit_diff, upcycle


def test_builds_exactly_the_listed_layers_and_round_trips(tmp_path):
    cfg = ModelConfig.tiny(n_layers=5, moe_layers=(1, 2, 4))
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, True, True, False, True]
    assert cfg.num_moe_layers == 3
    torch.manual_seed(0)
    model = MoETransformer(cfg).eval()
    kinds = [type(b.ffn) for b in model.blocks]
    assert kinds == [SwiGLUFFN, MoELayer, MoELayer, SwiGLUFFN, MoELayer]
    ids = torch.randint(0, 64, (2, 7))
    out = model(ids)
    assert [r is not None for r in out.records] == [False, True, True, False, True]
    save_model(model, tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.cfg.moe_layers == (1, 2, 4)
    assert torch.equal(back(ids).logits, out.logits)
    # per-layer expert counts follow the placement's order
    pruned = ModelConfig.tiny(n_layers=5, moe_layers=(0, 3), experts_per_layer=(4, 2))
    assert pruned.moe_config(3).router.num_experts == 2


def test_placement_errors():
    for bad in ((2, 1), (0, 0), (5,), (-1,), (0.0,)):
        with pytest.raises(ValueError, match="moe_layers: must be None or sorted distinct"):
            ModelConfig.tiny(n_layers=5, moe_layers=bad)
    with pytest.raises(ValueError, match="replaces first_dense_layers"):
        ModelConfig.tiny(n_layers=4, moe_layers=(3,), first_dense_layers=1)
    with pytest.raises(ValueError, match="needs moe"):
        ModelConfig(n_layers=2, moe=None, moe_layers=(1,))
    empty = ModelConfig.tiny(n_layers=3, moe_layers=())
    assert empty.num_moe_layers == 0


def test_dense_twin_and_selective_upcycling():
    cfg = ModelConfig.tiny(n_layers=4, moe_layers=(1, 3))
    twin = dense_twin_config(cfg)
    assert twin.moe is None and twin.moe_layers is None
    torch.manual_seed(1)
    dense = MoETransformer(twin).eval()
    moe = upcycle(dense, num_experts=2, top_k=1, moe_layers=[0, 2])
    assert [b.is_moe for b in moe.blocks] == [True, False, True, False]
    ids = torch.randint(0, 64, (2, 6))
    assert max_logit_diff(dense, moe, ids) < 1e-4
    # the dense layers are copied as they are
    assert torch.equal(moe.blocks[1].ffn.w_down.weight, dense.blocks[1].ffn.w_down.weight)


def test_observe_blocks_sees_every_block_output():
    torch.manual_seed(2)
    model = MoETransformer(ModelConfig.tiny(n_layers=3, moe_layers=(1,))).eval()
    ids = torch.randint(0, 64, (2, 5))
    seen: dict[int, torch.Tensor] = {}
    with torch.no_grad(), observe_blocks(model, lambda i, b, h: seen.__setitem__(i, h)):
        model(ids)
    assert sorted(seen) == [0, 1, 2]
    # the last block's output, normed and projected, gives the model's logits exactly
    with torch.no_grad():
        logits = model.lm_head(model.norm(seen[2])) * model.cfg.logit_scale
        assert torch.allclose(logits, model(ids).logits, atol=1e-6)
    # one block only, with the graph kept
    kept: list[torch.Tensor] = []
    with observe_blocks(model, lambda i, b, h: kept.append(h), layers=[1]):
        model(ids)
    assert len(kept) == 1 and kept[0].requires_grad
    with pytest.raises(ValueError, match=r"layers: \[3\] not in \[0, 3\)"):
        observe_blocks(model, lambda *a: None, layers=[3]).__enter__()
    with pytest.raises(ValueError, match="no 'blocks' ModuleList"):
        observe_blocks(torch.nn.Linear(2, 2), lambda *a: None).__enter__()
