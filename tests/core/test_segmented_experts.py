"""Expert banks made of segments: freezing single experts leaves the layer's output alone and
keeps the frozen experts bit-identical under AdamW with weight decay; growing appends trainable
experts beside frozen old ones; the optimizer, saving and LoRA refuse what they cannot handle."""

from __future__ import annotations

import copy

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.experts import ExpertBank
from moelab.core.experts.segmented import SegmentedExpertBank
from moelab.core.growth import (
    consolidate_experts,
    freeze_experts,
    frozen_parameter_names,
    grow_experts,
)
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models import (
    ModelConfig,
    MoETransformer,
    consolidate_model_experts,
    count_params,
    load_model,
    save_model,
)
from moelab.models.io import CheckpointError
from moelab.models.lora import add_expert_lora
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.optim import ShardedOptimizer, build_optimizer

D = 16


def make_layer(seed: int = 0, **router) -> MoELayer:
    torch.manual_seed(seed)
    rc = RouterConfig(num_experts=router.pop("num_experts", 4), top_k=2, **router)
    ex = ExpertsConfig(hidden_size=D, ffn_hidden_size=8, init_std=0.2)
    return MoELayer(MoEConfig(router=rc, experts=ex))


def expert_tensors(bank, e: int) -> dict[str, torch.Tensor]:
    """Every parameter slice of expert e, cloned."""
    if isinstance(bank, SegmentedExpertBank):
        s, i = bank.locate(e)
        bank, e = bank.segments[s], i
    return {n: p.detach()[e].clone() for n, p in bank.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(layer: MoELayer, steps: int = 10) -> None:
    """AdamW (weight decay 0.1) on every parameter that requires grad."""
    opt = torch.optim.AdamW(
        [p for p in layer.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, D, generator=g)
        opt.zero_grad()
        layer(x).hidden_states.pow(2).mean().backward()
        opt.step()


def test_freeze_experts_keeps_output_and_segments():
    layer = make_layer()
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        want = layer(x).hidden_states
    bank = freeze_experts(layer, [1, 2])
    assert bank.sizes == (1, 2, 1) and bank.frozen == (False, True, False)
    assert bank.expert_frozen() == [False, True, True, False]
    with torch.no_grad():
        got = layer(x).hidden_states
    assert (got - want).abs().max() <= 1e-6
    assert frozen_parameter_names(layer) == {
        "experts.segments.1.w_gate_up",
        "experts.segments.1.w_down",
    }
    # freezing one more expert keeps the earlier ones frozen and re-splits only what changes
    seg0 = bank.segments[0]
    bank = freeze_experts(layer, [3])
    assert bank.sizes == (1, 2, 1) and bank.frozen == (False, True, True)
    assert bank.segments[0] is seg0
    with torch.no_grad():
        assert (layer(x).hidden_states - want).abs().max() <= 1e-6


def test_frozen_experts_bit_identical_after_adamw_with_decay():
    layer = make_layer()
    freeze_experts(layer, [0, 2])
    before = {e: expert_tensors(layer.experts, e) for e in range(4)}
    router = layer.router.weight.detach().clone()
    train(layer)
    for e in (0, 2):
        assert same(expert_tensors(layer.experts, e), before[e])
    for e in (1, 3):
        after = expert_tensors(layer.experts, e)
        assert all(not torch.equal(after[k], before[e][k]) for k in after)
    assert not torch.equal(layer.router.weight, router)


def test_activations_and_expert_output_match_plain_bank():
    # biases and LoRA factors are sliced per expert like the weights
    torch.manual_seed(0)
    cfg = ExpertsConfig(
        hidden_size=D, ffn_hidden_size=8, activation="gelu", bias=True, lora_rank=2, init_std=0.2
    )
    layer = MoELayer(MoEConfig(router=RouterConfig(num_experts=5, top_k=2), experts=cfg))
    with torch.no_grad():
        for n, p in layer.experts.named_parameters():
            if n.startswith(("b_", "lora_B")):
                p.normal_(std=0.3)
    plain = copy.deepcopy(layer.experts)
    bank = freeze_experts(layer, [1, 4])
    x = torch.randn(10, D)
    counts = torch.tensor([3, 0, 4, 1, 2])
    y, acts = bank(x, counts, return_activations=True)
    y0, acts0 = plain(x, counts, return_activations=True)
    assert (y - y0).abs().max() <= 1e-6 and (acts - acts0).abs().max() <= 1e-6
    for e in range(5):
        assert torch.allclose(bank.expert_output(x, e), plain.expert_output(x, e), atol=1e-6)
    assert (bank.consolidate()(x, counts) - y0).abs().max() <= 1e-6


def test_grow_keeps_old_experts_frozen_and_trains_new_ones():
    layer = make_layer(expert_bias=True)
    old = {e: expert_tensors(layer.experts, e) for e in range(4)}
    old_rows = layer.router.weight.detach().clone()
    bank = grow_experts(layer, 2)
    assert bank.sizes == (4, 2) and bank.frozen == (True, False)
    assert layer.config.router.num_experts == 6 and layer.router.config.num_experts == 6
    assert layer.router.weight.shape == (6, D) and layer.router.expert_bias.shape == (6,)
    assert torch.equal(layer.router.weight[:4], old_rows)
    assert layer(torch.randn(5, D)).hidden_states.shape == (5, D)
    new = {e: expert_tensors(layer.experts, e) for e in (4, 5)}
    train(layer)
    for e in range(4):
        assert same(expert_tensors(layer.experts, e), old[e])
    for e in (4, 5):
        after = expert_tensors(layer.experts, e)
        assert all(not torch.equal(after[k], new[e][k]) for k in after)
    assert not torch.equal(layer.router.weight[:4], old_rows)  # the router keeps training


def test_grow_preserves_output_where_new_experts_are_not_selected():
    # normalised top-2 weights: unselected experts do not change the combine weights
    layer = make_layer(expert_bias=True)
    x = torch.randn(4, 9, D)
    with torch.no_grad():
        want = layer(x).hidden_states
        grow_experts(layer, 3)
        layer.router.expert_bias[4:] = -1e4  # selection only: the new experts lose every race
        got = layer(x)
    assert got.plan.expert_idx.max() < 4
    assert (got.hidden_states - want).abs().max() <= 1e-6


def test_grow_copy_init():
    layer = make_layer(expert_bias=True)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    src = {e: expert_tensors(layer.experts, e) for e in range(4)}
    rows = layer.router.weight.detach().clone()
    grow_experts(layer, 1, init="copy", source=2)
    assert same(expert_tensors(layer.experts, 4), src[2])
    assert torch.equal(layer.router.weight[4], rows[2])
    grow_experts(layer, 2, init="copy", source=[0, 1, 3])  # CaRE: the mean of experts
    for e in (5, 6):
        got = expert_tensors(layer.experts, e)
        for k in got:
            mean = (src[0][k] + src[1][k] + src[3][k]) / 3
            assert torch.allclose(got[k], mean, atol=1e-7)
        assert torch.allclose(layer.router.weight[e], rows[[0, 1, 3]].mean(0))
    assert torch.allclose(layer.router.expert_bias[5:], torch.tensor([0.7 / 3, 0.7 / 3]))
    assert layer.experts.frozen == (True, True, False)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_new": 0}, "n_new: must be an int >= 1"),
        ({"n_new": -2}, "n_new"),
        ({"n_new": 1.5}, "n_new"),
        ({"n_new": 1, "init": "zeros"}, "init: must be one of"),
        ({"n_new": 1, "init": "copy"}, "source: init='copy' needs"),
        ({"n_new": 1, "source": 0}, "source: only used with init='copy'"),
        ({"n_new": 1, "init": "copy", "source": 4}, r"source: expert indices must be in \[0, 4\)"),
    ],
)
def test_grow_errors(kw, match):
    layer = make_layer()
    with pytest.raises(InvalidValueError, match=match):
        grow_experts(layer, **kw)
    assert type(layer.experts) is ExpertBank  # nothing changed


def test_freeze_errors():
    layer = make_layer()
    with pytest.raises(InvalidValueError, match=r"expert_ids: expert indices must be in \[0, 4\)"):
        freeze_experts(layer, [4])
    with pytest.raises(InvalidValueError, match="at least one"):
        freeze_experts(layer, [])
    g = make_layer(n_group=2, topk_group=1)
    with pytest.raises(InvalidValueError, match="num_experts"):  # 5 experts in 2 groups
        grow_experts(g, 1)


def test_stacked_attributes_refused_clearly():
    layer = make_layer()
    freeze_experts(layer, [0])
    with pytest.raises(AttributeError, match="consolidate_experts"):
        layer.experts.w_down  # noqa: B018
    assert getattr(layer.experts, "b_down", None) is None  # hasattr-style probes still work
    assert isinstance(consolidate_experts(layer), ExpertBank)


def tiny_model(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=2)).eval()


def test_optimizer_refuses_frozen_experts():
    model = tiny_model()
    freeze_experts(model.blocks[0].ffn, [1])
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    names = {n for g in opt.layout for n, _ in g["shards"]}
    assert "blocks.0.ffn.experts.segments.1.w_down" not in names
    assert "blocks.0.ffn.experts.segments.0.w_down" in names
    frozen = "blocks.0.ffn.experts.segments.1.w_down"
    layout = [{"optimizer": "adamw", "weight_decay": 0.1, "shards": [[frozen, None]]}]
    with pytest.raises(ConfigError, match=f"parameter '{frozen}' is frozen"):
        ShardedOptimizer(model, cfg, layout)
    model.requires_grad_(True)  # a frozen expert switched back on is still refused
    with pytest.raises(ConfigError, match=f"parameter '{frozen[:-6]}w_gate_up' is frozen"):
        build_optimizer(model, cfg)


def test_save_refused_until_consolidated(tmp_path):
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 6))
    grow_experts(model.blocks[1].ffn, 2, init="copy", source=0)
    freeze_experts(model.blocks[0].ffn, [3])
    with torch.no_grad():
        want = model(ids).logits
    with pytest.raises(CheckpointError, match="consolidate_model_experts"):
        save_model(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    with pytest.raises(InvalidValueError, match="consolidate_model_experts"):
        add_expert_lora(model, rank=2)
    consolidate_model_experts(model)
    assert model.cfg.experts_per_layer == (4, 6) and model.cfg.moe.router.num_experts == 6
    assert (model(ids).logits - want).abs().max() <= 1e-6
    save_model(model, tmp_path / "m")
    again = load_model(tmp_path / "m").eval()
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_save_refuses_layers_the_config_does_not_describe(tmp_path):
    model = tiny_model()
    model.blocks[0].ffn.experts = ExpertBank(model.cfg.moe.experts, 5)  # swapped by hand
    with pytest.raises(CheckpointError, match=r"has shape .* what model\.cfg describes"):
        save_model(model, tmp_path / "m")


def test_count_params_sees_segmented_banks():
    model = tiny_model()
    want = count_params(model)
    freeze_experts(model.blocks[0].ffn, [0, 3])
    assert count_params(model) == want


def test_sharding_or_pruning_a_segmented_bank_says_to_consolidate():
    from moelab.core.experts.select import check_selectable

    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2),
            experts=ExpertsConfig(hidden_size=8, ffn_hidden_size=8),
        )
    )
    freeze_experts(layer, [0])
    with pytest.raises(ValueError, match=r"pruning: l0 holds a SegmentedExpertBank.*consolidate"):
        check_selectable(layer.experts, "l0", "pruning")
