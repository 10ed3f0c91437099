import pytest
import torch

from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.io import load_learner, save_learner
from moelab.methods.continual.upcycling_settings import UpcyclingSettings
from moelab.models.bert_moe import drop_newest, grow_copy, moe_forward, moe_from_bert_ffn
from moelab.models.encoder import BertFFN
from moelab.models.encoder_config import BertConfig
from moelab.train.gumbel_mask import GumbelLayerMask, annealed_temperature

from ._tiny import tiny_encoder, tokenize


def _ffn(seed: int = 0) -> BertFFN:
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=8,
    )
    ffn = BertFFN(cfg)
    with torch.no_grad():
        ffn.up.bias.normal_()
        ffn.down.bias.normal_()
    return ffn


def test_grown_layer_with_the_new_router_logit_at_minus_inf_equals_the_dense_ffn():
    ffn = _ffn()
    x = torch.randn(3, 5, 8)
    layer = moe_from_bert_ffn(ffn)
    # at growth: two identical experts with weight 1/2 each
    assert torch.allclose(layer(x).hidden_states, ffn(x), atol=1e-6)
    with torch.no_grad():  # make the new expert and its router row differ
        for seg in layer.experts.segments[1:]:
            for p in seg.parameters():
                p.add_(torch.randn_like(p))
        layer.router.weight[1].normal_()
    assert not torch.allclose(moe_forward(layer, x, None, exclude_newest=False), ffn(x), atol=1e-3)
    assert torch.allclose(moe_forward(layer, x, None, exclude_newest=True), ffn(x), atol=1e-6)
    # a third expert: excluding it gives back the two-expert layer
    two = moe_forward(layer, x, None, exclude_newest=False)
    grow_copy(layer)
    assert layer.experts.num_experts == 3 and layer.experts.frozen == (True, True, False)
    assert torch.equal(layer.router.weight[2], torch.zeros(8))
    assert torch.allclose(moe_forward(layer, x, None, exclude_newest=True), two, atol=1e-6)
    drop_newest(layer)
    assert layer.experts.num_experts == 2 and tuple(layer.router.weight.shape) == (2, 8)
    assert torch.allclose(moe_forward(layer, x, None, exclude_newest=False), two, atol=1e-6)


def test_gumbel_hard_sample_is_one_hot_with_straight_through_gradients():
    mask = GumbelLayerMask(4)
    with torch.no_grad():
        mask.alpha.copy_(torch.tensor([[0.0, 2.0], [1.0, -1.0], [0.3, 0.1], [0.0, 0.0]]))
    w = torch.tensor([1.0, -2.0, 3.0, 0.5])
    m = mask.sample(0.5, torch.Generator().manual_seed(3))
    (m * w).sum().backward()
    grad = mask.alpha.grad.clone()
    # the same noise, soft: the forward is its one-hot argmax, the gradient is its gradient
    mask.alpha.grad = None
    u = torch.rand(4, 2, generator=torch.Generator().manual_seed(3)).clamp_(1e-10, 1 - 1e-7)
    soft = torch.softmax((mask.alpha - torch.log(-torch.log(u))) / 0.5, -1)
    assert set(m.tolist()) <= {0.0, 1.0}
    assert torch.equal(m.detach(), (soft.argmax(-1) == 1).float())
    (soft[:, 1] * w).sum().backward()
    assert torch.allclose(grad, mask.alpha.grad) and bool((grad != 0).all())
    assert mask.decide() == [True, False, False, False]
    assert annealed_temperature(0, 11) == 1.0
    assert annealed_temperature(10, 11) == pytest.approx(0.1)
    assert annealed_temperature(5, 11) == pytest.approx(0.1**0.5)


def _learner(method: str, **settings):
    config = ContinualConfig(
        stream="synthetic-domains",
        scenario="task",
        method=method,
        train_per_class=6,
        test_per_class=3,
        adapted_blocks=3,
        batch_size=8,
        upcycling=UpcyclingSettings(steps=6, replay_batch=4, probe_size=8, **settings),
    )
    recipe = ContinualRecipe(tiny_encoder(), tokenize)
    torch.manual_seed(0)
    return recipe.learner(config, 0), recipe, config


def test_old_experts_are_bit_identical_after_a_task_and_growth_is_counted():
    learner, _, _ = _learner("full-upcycling")
    learner.learn(0)
    old = [
        [p.detach().clone() for seg in site.moe.experts.segments for p in seg.parameters()]
        for site in learner.sites
    ]
    assert all(not p.requires_grad for site in learner.sites for p in site.moe.experts.parameters())
    learner.learn(1)
    for site, before in zip(learner.sites, old, strict=True):
        assert site.num_experts == 3
        after = [p for seg in site.moe.experts.segments for p in seg.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after[: len(before)], strict=True))
        # expert 0 is still the pretrained FFN
        assert torch.equal(site.moe.experts.segments[0].w_up[0], site.dense.up.weight.T)
    m = learner.growth_metrics()
    assert m["growth_vs_full"] == 100.0 and m["grown_sites"] == 6
    assert m["expert_params_added"] == 6 * (2 * 16 * 32 + 32 + 16)
    assert len(learner.cka_curves) == 2 and all(0 <= c <= 1 + 1e-6 for c in learner.cka_curves[1])


def test_seqft_replay_trains_the_ffns_and_never_grows():
    learner, _, _ = _learner("seqft-replay")
    before = learner.sites[0].dense.up.weight.detach().clone()
    learner.learn(0)
    learner.learn(1)
    assert not torch.equal(before, learner.sites[0].dense.up.weight)
    assert all(site.moe is None for site in learner.sites)
    assert learner.growth_metrics()["growth_vs_full"] == 0.0
    assert len(learner.memory) == sum(min(20, len(learner.stream.tasks[t].train)) for t in (0, 1))


def test_selective_search_keeps_what_the_mask_decides_and_saves(tmp_path):
    # a huge size penalty makes every site keep; none grows
    learner, recipe, config = _learner(
        "selective-upcycling", size_weight=1e4, mask_lr=0.5, outer_every=1
    )
    learner.learn(0)
    assert learner.growth == [[False] * 3] and all(s.moe is None for s in learner.sites)
    assert all(p < 0.5 for p in learner.grow_probs[0])
    # without a penalty: the structure follows the recorded decisions, and it saves and loads
    learner, recipe, config = _learner("selective-upcycling", size_weight=0.0)
    learner.learn(0)
    learner.learn(1)
    grown = [sum(site) for site in zip(*learner.growth, strict=True)]
    assert [s.num_experts for s in learner.sites] == [1 + g for g in grown]
    save_learner(learner, 0, tmp_path / "run")
    fresh = recipe.learner(config, 0)
    load_learner(tmp_path / "run", fresh)
    idx = list(learner.stream.tasks[1].test)
    assert torch.equal(fresh.logits(idx), learner.logits(idx))
