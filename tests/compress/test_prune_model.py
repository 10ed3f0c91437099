"""Pruned models: layer equivalence, per-layer expert counts, save/load, export, NAEE, pipeline."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from moelab.compress.calibration import route
from moelab.compress.prune import apply_pruning, build_criterion, prune_experts, prune_layer
from moelab.compress.prune.criteria import SubsetErrors
from moelab.core.layer import MoELayer
from moelab.interop.errors import UnsupportedConfigError
from moelab.interop.hf import hf_state
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.hooks import moe_layers
from moelab.models.lora import add_expert_lora


def _masked_reference(layer: MoELayer, x, removed):
    """The unpruned layer with the removed experts' router logits set to -inf (and their
    selection bias, which would otherwise still make them selectable)."""
    original = layer.router.logits
    bias = layer.router.expert_bias
    if bias is not None:
        layer.router.expert_bias = bias.clone().index_fill_(0, torch.tensor(removed), -torch.inf)

    def masked(x_TD):
        out = original(x_TD).clone()
        out[:, removed] = float("-inf")
        return out

    layer.router.logits = masked
    try:
        return layer(x).hidden_states
    finally:
        del layer.router.logits
        layer.router.expert_bias = bias


ROUTERS = [
    {},
    {"norm_topk_prob": False},
    {"softmax_before_topk": False},
    {"score_func": "sigmoid", "routed_scaling_factor": 2.5},
    {"expert_bias": True},
    {"shared_expert_size": 8, "k": 3},
]


@pytest.mark.parametrize("router", ROUTERS)
def test_pruned_layer_equals_unpruned_with_removed_logits_at_minus_inf(make_model, router):
    model = make_model(E=6, **router)
    layer = moe_layers(model)[0]
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.4, 6))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    keep = [0, 2, 3, 5]
    pruned = prune_layer(layer, keep)
    assert pruned.experts.num_experts == 4 and pruned.router.weight.shape == (4, 16)
    assert torch.equal(pruned.router.weight, layer.router.weight[keep])
    assert torch.equal(pruned.experts.w_down, layer.experts.w_down[keep])
    if layer.router.expert_bias is not None:
        assert torch.equal(pruned.router.expert_bias, layer.router.expert_bias[keep])
    if layer.shared_expert is not None:
        assert torch.equal(pruned.shared_expert.w_down, layer.shared_expert.w_down)
    ref = _masked_reference(layer, x, [1, 4])
    torch.testing.assert_close(pruned(x).hidden_states, ref, rtol=1e-12, atol=1e-12)


def test_top_k_is_clamped_to_the_experts_left(make_model):
    layer = moe_layers(make_model(E=6, k=3))[0]
    pruned = prune_layer(layer, [1, 4])
    assert pruned.config.router.top_k == 2
    x = torch.randn(5, 16, dtype=torch.float64)
    ref = _masked_reference(layer, x, [0, 2, 3, 5])
    torch.testing.assert_close(pruned(x).hidden_states, ref)
    for bad in ([], [0, 0], [6], [-1]):
        with pytest.raises(ValueError, match="keep"):
            prune_layer(layer, bad)


def test_per_layer_counts_save_reload_identical(make_model, make_batches, tmp_path):
    model = make_model(E=6, layers=3)
    pruned = apply_pruning(model, [[0, 1, 2, 3, 4], None, [1, 5]])
    assert pruned.cfg.experts_per_layer == (5, 6, 2)
    assert [m.experts.num_experts for m in moe_layers(model)] == [6, 6, 6]  # not modified
    save_model(pruned, tmp_path / "p")
    saved = json.loads((tmp_path / "p" / "config.json").read_text())
    assert saved["model"]["experts_per_layer"] == [5, 6, 2]
    again = load_model(tmp_path / "p")
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in pruned.state_dict().items()
    }
    assert again.blocks[2].ffn.experts.w_down.shape == (2, 12, 16)
    assert again.blocks[2].ffn.config.router.top_k == 2
    ids = make_batches(n=1)[0]
    assert torch.equal(again(ids).logits, pruned(ids).logits)
    assert not torch.equal(model(ids).logits, pruned(ids).logits)


def test_uniform_counts_give_a_plain_config_that_exports(make_model):
    model = make_model(E=6).float()
    pruned = apply_pruning(model, [[0, 1, 2, 3], [2, 3, 4, 5]])
    assert pruned.cfg.experts_per_layer is None and pruned.cfg.moe.router.num_experts == 4
    hf, _, _ = hf_state(pruned, "mixtral")
    assert hf["num_local_experts"] == 4
    uneven = apply_pruning(model, [[0, 1, 2, 3], [2, 3]])
    with pytest.raises(UnsupportedConfigError, match="layer 1 has 2"):
        hf_state(uneven, "mixtral")


def test_older_config_without_per_layer_counts_still_loads_and_bad_counts_are_refused():
    d = ModelConfig.tiny().to_dict()
    d.pop("experts_per_layer")
    cfg = ModelConfig.from_dict(d)
    assert cfg.experts_per_layer is None and cfg.moe_config(0) is cfg.moe
    for bad in ((4,), (4, 0), (4, 2.0)):
        with pytest.raises(ValueError, match="experts_per_layer"):
            ModelConfig.tiny(experts_per_layer=bad)
    with pytest.raises(ValueError, match="experts_per_layer"):
        ModelConfig(vocab_size=8, d_model=8, n_heads=2, moe=None, experts_per_layer=(2, 2))
    cfg = ModelConfig.tiny(num_experts=4, top_k=2, experts_per_layer=[1, 3])
    assert cfg.experts_per_layer == (1, 3) and cfg.moe_config(0).router.top_k == 1
    assert MoETransformer(cfg).blocks[1].ffn.experts.num_experts == 3


@pytest.mark.parametrize("router", [{}, {"expert_bias": True}, {"norm_topk_prob": False}])
def test_naee_streaming_loss_equals_brute_force_over_pruned_layers(
    make_model, make_batches, router
):
    model = make_model(E=5, k=2, **router)
    layer = moe_layers(model)[0]
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.2, -0.1, 0.0, 0.3, -0.2]))
    batches = make_batches(n=3)
    acc = SubsetErrors(layer, 3)
    inputs = []

    def observe(i, lay, x, out):
        if i == 0:
            acc.update(lay, x, out)
            inputs.append((x, out.hidden_states))

    route(model, batches, observe)
    assert len(acc.dropped) == 10
    for c, dropped in enumerate(itertools.combinations(range(5), 2)):
        pruned = prune_layer(layer, [e for e in range(5) if e not in dropped])
        with torch.no_grad():
            ref = sum(float((z - pruned(x).hidden_states).norm()) for x, z in inputs)
        assert float(acc.loss[c]) == pytest.approx(ref, rel=1e-9, abs=1e-9)
    sel = build_criterion("naee").select(acc, 3)
    best = min(range(10), key=lambda c: float(acc.loss[c]))
    assert sel.keep == [e for e in range(5) if e not in acc.dropped[best]]


@pytest.mark.parametrize("method", ["frequency", "soft-frequency", "reap", "naee", "ragep"])
@pytest.mark.parametrize("per_layer", ["uniform", "rank"])
def test_pipeline_prunes_to_the_budget(make_model, make_batches, method, per_layer):
    model = make_model(E=6, layers=3)
    crit = build_criterion(method, **({"pca_rank": 2} if method == "ragep" else {}))
    res = prune_experts(model, make_batches(n=3), crit, 0.5, per_layer=per_layer)
    counts = [m.experts.num_experts for m in moe_layers(res.model)]
    assert sum(counts) == res.budget == 9 and all(c >= 2 for c in counts)
    assert [r.kept for r in res.layers] == counts
    if per_layer == "uniform":
        assert counts == [3, 3, 3]
    assert all(r.effective_rank > 1 for r in res.layers)
    ids = make_batches(n=1)[0]
    assert res.model(ids).logits.shape == (2, 8, 37)
    d = res.to_dict()
    assert d["budget"] == 9 and len(d["layers"]) == 3 and json.dumps(d)


def test_frequency_keeps_the_most_routed_experts(make_model, make_batches):
    model = make_model(E=6, layers=1)
    counts = torch.zeros(6, dtype=torch.int64)

    def observe(i, layer, x, out):
        counts.add_(torch.bincount(out.plan.expert_idx, minlength=6))

    batches = make_batches(n=3)
    route(model, batches, observe)
    res = prune_experts(model, batches, build_criterion("frequency"), 3)
    assert res.layers[0].keep == sorted(torch.argsort(-counts, stable=True)[:3].tolist())
    assert res.layers[0].scores == counts.double().tolist()


def test_ragep_scores_later_layers_on_the_already_pruned_model(make_model, make_batches):
    model = make_model(E=6, layers=2)
    batches = make_batches(n=3)
    crit = build_criterion("ragep", pca_rank=2, beta=0.5)
    res = prune_experts(model, batches, crit, 6, per_layer="uniform")
    first = apply_pruning(model, [res.layers[0].keep, None])
    acc = crit.accumulator(moe_layers(first)[1], 3)
    route(first, batches, lambda i, lay, x, out: acc.update(lay, x, out) if i == 1 else None)
    assert crit.select(acc, 3).scores == pytest.approx(res.layers[1].scores)


def test_ragep_carried_states_equal_a_full_pass_per_layer(make_model, make_batches):
    """The sequential pipeline carries the calibration states up the pruned copy; the
    reference re-runs the whole set from the embeddings for every layer (stopped after it):
    the same scores, kept sets and pruned model, bit for bit, with a dense block first."""
    model = make_model(E=6, layers=4)
    model = MoETransformer(dataclasses.replace(model.cfg, first_dense_layers=1)).double().eval()
    batches = make_batches(n=3)
    crit = build_criterion("ragep", pca_rank=2, beta=0.5)
    res = prune_experts(model, batches, crit, 9, per_layer="uniform")
    work = model
    for j in range(3):
        acc = crit.accumulator(moe_layers(work)[j], 3)
        route(
            work, batches,
            lambda i, lay, x, out, j=j, acc=acc: acc.update(lay, x, out) if i == j else None,
            upto_layer=j,
        )  # fmt: skip
        sel = crit.select(acc, 3)
        assert sel.scores == res.layers[j].scores and sel.keep == res.layers[j].keep
        work = apply_pruning(work, [sel.keep if i == j else None for i in range(3)])
    ids = batches[0]
    assert torch.equal(res.model(ids).logits, work(ids).logits)
    assert not res.model.training and [len(k.keep) for k in res.layers] == [3, 3, 3]


def test_advance_equals_hidden_at_and_checks_its_blocks(make_model, make_batches):
    model = make_model(layers=3)
    ids = make_batches(n=1)[0]
    h1 = model.hidden_at(ids, block=1)
    assert torch.equal(
        model.advance(h1, start_block=1, stop_block=3), model.hidden_at(ids, block=3)
    )
    assert torch.equal(model.advance(h1, start_block=1, stop_block=1), h1)
    with pytest.raises(ValueError, match="stop_block: must be >= start_block=2, got 1"):
        model.advance(h1, start_block=2, stop_block=1)
    with pytest.raises(ValueError, match=r"stop_block: must be in \[0, 3\], got 4"):
        model.advance(h1, start_block=0, stop_block=4)
    with pytest.raises(ValueError, match=r"hidden: expected a \[B, S, 16\] tensor, got \(8, 16\)"):
        model.advance(h1[0], start_block=0, stop_block=1)


def test_bad_inputs_are_refused_before_any_work(make_model, make_batches):
    model = make_model(E=6, layers=2)
    crit = build_criterion("frequency")
    b = make_batches(n=1)
    for keep, msg in ((0.0, "keep"), (1.0, "keep"), (12, "keep"), (3, "below"), (0.3, "below")):
        with pytest.raises(ValueError, match=msg):
            prune_experts(model, b, crit, keep)
    with pytest.raises(ValueError, match="per_layer"):
        prune_experts(model, b, crit, 0.5, per_layer="nope")
    with pytest.raises(ValueError, match="method"):
        build_criterion("magic")
    dense = MoETransformer(ModelConfig(vocab_size=37, d_model=8, n_heads=2, moe=None))
    with pytest.raises(ValueError, match="dense"):
        prune_experts(dense, b, crit, 0.5)
    ec = make_model(E=6, kind="expert_choice")
    with pytest.raises(ValueError, match="token-choice"):
        prune_experts(ec, b, crit, 0.5)


class _Passes:
    """A progress sink that records the calibration passes started."""

    def __init__(self):
        self.passes = []

    def start_pass(self, label, total_tokens):
        self.passes.append(label)

    def __call__(self, n_tokens):
        pass


def _model_with(make_model, bias=False, lora=0):
    model = make_model(E=6)
    if bias:
        cfg = model.cfg
        ex = dataclasses.replace(cfg.moe.experts, bias=True)
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts=ex))
        torch.manual_seed(0)
        model = MoETransformer(cfg).double().eval()
    if lora:
        model = add_expert_lora(model, lora)
    with torch.no_grad():  # non-zero biases and adapters: a lost one changes the outputs
        for name, p in model.named_parameters():
            if ".experts.b_" in name or ".experts.lora_" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [{"bias": True}, {"lora": 2}, {"bias": True, "lora": 3}])
def test_experts_with_biases_or_adapters_prune_exactly(make_model, kw):
    """Every per-expert tensor is cut (it used to be a fixed list of weights: biases and LoRA
    adapters made a size-mismatch RuntimeError after calibration), trainability kept."""
    model = _model_with(make_model, **kw)
    layer = moe_layers(model)[0]
    for n, p in layer.named_parameters():
        p.requires_grad_("lora_" in n or "router" in n)
    pruned = prune_layer(layer, [0, 2, 3, 5])
    assert {n: p.requires_grad for n, p in pruned.named_parameters()} == {
        n: p.requires_grad for n, p in layer.named_parameters()
    }
    for n, p in layer.experts.named_parameters():
        assert torch.equal(getattr(pruned.experts, n), p[[0, 2, 3, 5]]), n
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    ref = _masked_reference(layer, x, [1, 4])
    torch.testing.assert_close(pruned(x).hidden_states, ref, rtol=1e-12, atol=1e-12)
    res = prune_experts(model, [torch.randint(0, 37, (2, 8))], build_criterion("frequency"), 8,
                        per_layer="uniform")  # fmt: skip
    assert [lay.experts.num_experts for lay in moe_layers(res.model)] == [4, 4]


def test_unprunable_banks_are_refused_before_calibration(make_model, make_batches):
    from moelab.compress.quant import QuantizeConfig, quantize_model
    from moelab.core.experts import QuantSpec

    model = make_model(E=6)
    spec = QuantSpec(method="rtn", bits=4, group_size=4)
    quantize_model(model, make_batches(1), QuantizeConfig(spec=spec, min_tokens=0))
    progress = _Passes()
    with pytest.raises(ValueError, match=r"pruning: layer 0 holds a QuantizedExpertBank"):
        prune_experts(model, make_batches(1), build_criterion("frequency"), 6, progress=progress)
    assert progress.passes == []  # refused before any calibration pass


def test_with_a_capacity_factor_the_pruned_layer_keeps_the_factor_over_its_own_experts(
    make_model, make_batches
):
    """Not the masked original: the pruned layer's capacity is ceil(T·k/E'·c) over its E'
    experts (hand-counted drops below), the original's ceil(T·k/E·c); NAEE, which models the
    pruned layer by masking, refuses such layers before calibrating."""
    layer = moe_layers(make_model(E=6, capacity_factor=1.0))[0]
    keep = [0, 2, 5]
    pruned = prune_layer(layer, keep)
    x = torch.randn(40, 16, dtype=torch.float64)
    with torch.no_grad():
        logits = layer.router.logits(x)
    top = logits[:, keep].topk(2, dim=-1).indices  # the pruned router's choice, before drops
    counts = torch.bincount(top.reshape(-1), minlength=3)
    cap_pruned, cap_masked = -(-40 * 2 // 3), -(-40 * 2 // 6)  # ceil(T·k/E'·c), ceil(T·k/E·c)
    assert (cap_pruned, cap_masked) == (27, 14)
    want = int((counts - cap_pruned).clamp_min(0).sum())
    masked = int((counts - cap_masked).clamp_min(0).sum())
    with torch.no_grad():
        assert pruned(x).plan.dropped == want
    assert masked > want  # the masked original would drop more
    progress = _Passes()
    model = make_model(E=6, capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"naee: needs a dropless router .*layer 0 has"):
        prune_experts(model, make_batches(1), build_criterion("naee"), 8, progress=progress)
    assert progress.passes == []
