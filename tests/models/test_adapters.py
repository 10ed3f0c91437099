"""Adapters injected by module name: LoRA starts as an exact no-op and merges back, MoE-LoRA
equals a slow per-token loop over experts and grows with its old experts frozen, bottleneck
adapters sit beside any module, and name-based freezing trains exactly what it names."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.core.growth import freeze_experts
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.adapters import (
    LoRALinear,
    MoELoRALinear,
    ParallelAdapter,
    ParallelAdapterWrapper,
    add_lora,
    add_moe_lora,
    add_parallel_adapters,
    freeze_except,
    merge_adapters,
)
from moelab.models.io import CheckpointError
from moelab.train.optim import trainable_parameters


def tiny_model(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=2)).eval()


def lm_steps(model: nn.Module, ids: torch.Tensor, steps: int = 5, wd: float = 0.0) -> None:
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(model)], lr=3e-2, weight_decay=wd)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model.loss(ids, ids.roll(-1, 1)).loss.backward()
        opt.step()
    model.eval()


def test_lora_is_an_exact_noop_at_injection():
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 9))
    want = model(ids).logits
    names = add_lora(model, ["q_proj", re.compile(r"blocks\.1\.attn\.[ov]_proj")], rank=4, alpha=8)
    assert names == [
        "blocks.0.attn.q_proj",
        "blocks.1.attn.q_proj",
        "blocks.1.attn.v_proj",
        "blocks.1.attn.o_proj",
    ]
    assert torch.equal(model(ids).logits, want)
    seq = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    want = seq(x)
    assert add_lora(seq, ["0", "2"], rank=2, alpha=1, dropout=0.1) == ["0", "2"]
    seq.train()  # dropout on the adapter input: still zeros through B = 0
    assert torch.equal(seq(x), want)


def test_lora_formula_and_merge_by_hand():
    torch.manual_seed(0)
    base = nn.Linear(5, 3)
    lora = LoRALinear(base, rank=2, alpha=3.0)
    assert not base.weight.requires_grad and lora.lora_A.requires_grad
    assert lora.lora_A.abs().max() <= 1 / 5**0.5  # PEFT: U(-1/sqrt(in), 1/sqrt(in))
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(7, 5)
    want = x @ base.weight.T + base.bias + 1.5 * (x @ lora.lora_A.T @ lora.lora_B.T)
    assert torch.allclose(lora(x), want, atol=1e-6)
    merged = lora.merge()
    assert type(merged) is nn.Linear
    assert torch.allclose(merged.weight, base.weight + 1.5 * lora.lora_B @ lora.lora_A)
    assert torch.allclose(merged(x), want, atol=1e-6)


def test_lora_trains_then_merges_and_saves(tmp_path):
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 9))
    base_logits = model(ids).logits
    add_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    n = freeze_except(model, ["lora_A", "lora_B"])
    assert n == 2 * 2 * (4 * 32 + 32 * 4)  # 2 layers x (q, v) x (A + B)
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    lm_steps(model, ids, wd=0.1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen_before.items())
    want = model(ids).logits
    assert (want - base_logits).abs().max() > 1e-3
    with pytest.raises(CheckpointError, match="merge_adapters"):
        save_model(model, tmp_path / "m")
    assert len(merge_adapters(model)) == 4
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert (model(ids).logits - want).abs().max() <= 1e-5
    save_model(model, tmp_path / "m")
    assert torch.equal(load_model(tmp_path / "m").eval()(ids).logits, model(ids).logits)


def moe_lora_reference(layer: MoELoRALinear, x: torch.Tensor) -> torch.Tensor:
    """Per token, per expert, in float64."""
    A, B = (t.double() for t in layer.experts())
    W, b = layer.base.weight.double(), layer.base.bias.double()
    Wr = layer.router.weight.double()
    out = []
    for xt in x.double():
        logits = Wr @ xt
        if layer.top_k is None:
            g = torch.softmax(logits, 0)
        else:
            idx = logits.argsort(descending=True)[: layer.top_k]
            g = torch.zeros_like(logits)
            g[idx] = torch.softmax(logits[idx], 0)
        y = W @ xt + b
        for e in range(A.shape[0]):
            y = y + g[e] * layer.scaling * (B[e] @ (A[e] @ xt))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("top_k", [None, 2])
def test_moe_lora_matches_slow_reference(top_k):
    torch.manual_seed(0)
    layer = MoELoRALinear(nn.Linear(6, 4), num_experts=3, rank=2, alpha=4.0, top_k=top_k)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 5, 6)
    y = layer(x)
    assert y.shape == (2, 5, 4)
    ref = moe_lora_reference(layer, x.reshape(-1, 6)).reshape(2, 5, 4)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    rec = layer.last_record
    k = 3 if top_k is None else top_k
    assert rec.batch_shape == (2, 5) and int(rec.counts.sum()) == 10 * k
    assert layer.last_weights.shape == (2, 5, 3)
    assert torch.allclose(layer.last_weights.sum(-1), torch.ones(2, 5))
    if top_k is not None:
        assert ((layer.last_weights > 0).sum(-1) == 2).all()
    layer.grow(2)  # grown: still the same formula over old and new experts
    with torch.no_grad():
        layer.lora_B.normal_()
    ref = moe_lora_reference(layer, x.reshape(-1, 6)).reshape(2, 5, 4)
    assert torch.allclose(layer(x).double(), ref, atol=1e-5)


def test_moe_lora_injection_is_a_noop_and_grow_freezes_old_experts():
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 9))
    want = model(ids).logits
    add_moe_lora(model, ["v_proj"], num_experts=2, rank=2, alpha=4, top_k=1)
    assert torch.equal(model(ids).logits, want)
    freeze_except(model, ["lora_A", "lora_B", "router"])
    lm_steps(model, ids)
    layer = model.blocks[0].attn.v_proj
    old_A, old_B = (t.detach().clone() for t in layer.experts())
    layer.grow(3)
    for p in model.blocks[1].attn.v_proj.parameters():  # train one layer's adapters only
        p.requires_grad_(False)
    assert layer.num_experts == 5 and layer.num_frozen == 2
    assert not layer.old_lora_A.requires_grad and layer.lora_A.shape[0] == 3
    new_A = layer.lora_A.detach().clone()
    router = layer.router.weight.detach().clone()
    lm_steps(model, ids, steps=10, wd=0.1)
    A, B = layer.experts()
    assert torch.equal(A[:2], old_A) and torch.equal(B[:2], old_B)
    assert not torch.equal(A[2:], new_A) and B[2:].abs().max() > 0
    assert not torch.equal(layer.router.weight, router)
    with pytest.raises(InvalidValueError, match="n_new: must be an int >= 1"):
        layer.grow(0)
    model.requires_grad_(True)  # old experts switched back on are refused by name
    with pytest.raises(ValueError, match=re.escape("blocks.0.attn.v_proj.old_lora_A' is frozen")):
        trainable_parameters(model)


def test_parallel_adapter_formula_and_placements():
    torch.manual_seed(0)
    a = ParallelAdapter(6, 3, scale=0.5, layer_norm=True)
    x = torch.randn(4, 6)
    assert torch.equal(a(x), torch.zeros(4, 6))  # up = 0 at init
    with torch.no_grad():
        a.up.weight.normal_()
        a.up.bias.normal_()
    h = F.layer_norm(x, (6,))
    want = 0.5 * (torch.relu(h @ a.down.weight.T + a.down.bias) @ a.up.weight.T + a.up.bias)
    assert torch.allclose(a(x), want, atol=1e-6)
    ch = ParallelAdapter(6, 3, scale=0.0, learnable_scale="channel")
    assert ch.scale.shape == (6,) and ch.scale.requires_grad
    m = nn.Linear(6, 6)
    par = ParallelAdapterWrapper(m, a, source="input")
    seq = ParallelAdapterWrapper(m, a, source="output")
    assert torch.allclose(par(x), m(x) + a(x)) and torch.allclose(seq(x), m(x) + a(m(x)))
    assert par.weight is m.weight  # attributes come from the wrapped module


def test_parallel_adapters_on_blocks_and_moe_layers():
    model = tiny_model()
    ids = torch.randint(0, 40, (2, 9))
    want = model(ids)
    names = add_parallel_adapters(model, ["blocks.0.ffn", "blocks.1"], dim=32, bottleneck=4)
    assert names == ["blocks.0.ffn", "blocks.1"]
    got = model(ids)
    assert torch.equal(got.logits, want.logits) and len(got.records) == 2
    n = freeze_except(model, ["adapter"])
    assert n == 2 * (32 * 4 + 4 + 4 * 32 + 32)
    lm_steps(model, ids)
    block = model.blocks[1]
    x = torch.randn(2, 9, 32)
    out = block(x)
    assert torch.allclose(out[0], block.module(x)[0] + block.adapter(x), atol=1e-6)
    with pytest.raises(InvalidValueError, match="ParallelAdapterWrapper, which cannot be merged"):
        merge_adapters(model)


def test_router_only_training():
    model = tiny_model()
    freeze_experts(model.blocks[0].ffn, [0])
    n = freeze_except(model, ["router"])
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    assert names == ["blocks.0.ffn.router.weight", "blocks.1.ffn.router.weight"]
    assert n == 2 * 4 * 32
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lm_steps(model, torch.randint(0, 40, (2, 9)))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == set(names)
    # a frozen expert stays frozen even when a pattern names it
    freeze_except(model, ["experts"])
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}
    assert "blocks.0.ffn.experts.segments.0.w_down" in frozen
    assert "blocks.0.ffn.experts.segments.1.w_down" not in frozen


def test_errors_name_the_pattern():
    model = tiny_model()
    with pytest.raises(InvalidValueError, match=r"'k_prj' matches no module; nn.Linear modules "
                       r"include blocks.0.attn.q_proj"):  # fmt: skip
        add_lora(model, ["q_proj", "k_prj"], rank=2, alpha=4)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing replaced
    with pytest.raises(InvalidValueError, match=re.escape("matches blocks.0.attn, a Attention")):
        add_lora(model, ["attn"], rank=2, alpha=4)
    with pytest.raises(InvalidValueError, match=r"re.compile\('.\*w_proj'\) matches no module"):
        add_lora(model, [re.compile(".*w_proj")], rank=2, alpha=4)
    with pytest.raises(InvalidTypeError, match="wrap a single one in a list"):
        add_lora(model, "q_proj", rank=2, alpha=4)
    with pytest.raises(InvalidValueError, match=re.escape("select both blocks.0 and blocks.0.ffn")):
        add_parallel_adapters(model, ["blocks.0", "blocks.0.ffn"], dim=32, bottleneck=2)
    with pytest.raises(InvalidValueError, match="rank: must be an int >= 1"):
        add_lora(model, ["q_proj"], rank=0, alpha=4)
    with pytest.raises(InvalidValueError, match="'lora' matches no parameter"):
        freeze_except(model, ["lora"])
    with pytest.raises(InvalidValueError, match="no LoRALinear adapters to merge"):
        merge_adapters(model)
    add_lora(model, ["q_proj"], rank=2, alpha=4)
    with pytest.raises(InvalidValueError, match=re.escape("a LoRALinear, where nn.Linear modules")):
        add_lora(model, ["q_proj"], rank=2, alpha=4)  # already wrapped
    model2 = copy.deepcopy(model)
    add_moe_lora(model2, ["k_proj"], num_experts=2, rank=2, alpha=4)
    with pytest.raises(InvalidValueError, match="k_proj is a MoELoRALinear"):
        merge_adapters(model2)
    assert isinstance(model2.blocks[0].attn.q_proj, LoRALinear)  # refused before any merge


def test_a_merged_lm_projection_keeps_its_class():
    # the LM's projections decode through the streaming kernel; merging LoRA must not lose it
    from moelab.models.linear import Linear

    base = Linear(6, 4)
    merged = LoRALinear(base, rank=2, alpha=2.0).merge()
    assert type(merged) is Linear and torch.equal(merged.weight, base.weight)
