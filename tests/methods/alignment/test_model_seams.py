"""MESA on a model: per-expert training leaves other experts bit-identical, the masking
attack never selects a masked expert, the top forward equals the full forward, refusal
matching and the routing loss."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import RouterConfig
from moelab.errors import InvalidValueError
from moelab.methods.alignment.attack import masked_experts
from moelab.methods.alignment.examples import Example, collate
from moelab.methods.alignment.freeze import LORA_NAMES, optimizer_groups, train_only
from moelab.methods.alignment.refusal import is_refusal
from moelab.methods.alignment.routing import dense_weights, forward_top, routing_kl, target_routing
from moelab.models import ModelConfig, MoETransformer
from moelab.models.lora import add_expert_lora
from moelab.train.upcycle import upcycle


def _moe(lora: bool = True) -> MoETransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        d_model=32,
        n_layers=3,
        n_heads=4,
        max_seq_len=64,
        moe=None,
        dense_ffn_size=32,
    )
    dense = MoETransformer(cfg).eval()
    moe = upcycle(
        dense,
        4,
        2,
        router_init="random",
        first_dense_layers=1,
        router=RouterConfig(norm_topk_prob=True),
    )
    return add_expert_lora(moe, rank=2).eval() if lora else moe.eval()


def test_unselected_experts_stay_bit_identical_after_training():
    model = _moe()
    with torch.no_grad():  # make the adapters matter from the first step
        for b in model.blocks[1:]:
            b.ffn.experts.lora_B_in.normal_(std=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_only(model, {1: [1], 2: [0, 3]}, routers=True)
    opt = torch.optim.AdamW(optimizer_groups(model, 1e-2, 1e-2, weight_decay=0.1))
    ids = torch.randint(0, 40, (2, 9))
    for _ in range(3):
        loss = model(ids).logits.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.state_dict()
    keep = {1: [1], 2: [0, 3]}
    for layer in (1, 2):
        for name in LORA_NAMES:
            key = f"blocks.{layer}.ffn.experts.{name}"
            for e in range(4):
                assert torch.equal(after[key][e], before[key][e]) == (e not in keep[layer]), (
                    key,
                    e,
                )
        assert not torch.equal(
            after[f"blocks.{layer}.ffn.router.weight"], before[f"blocks.{layer}.ffn.router.weight"]
        )
    assert torch.equal(
        after["blocks.1.ffn.experts.w_gate_up"], before["blocks.1.ffn.experts.w_gate_up"]
    )
    assert torch.equal(after["embed.weight"], before["embed.weight"])


def test_masking_attack_never_selects_masked_experts():
    model = _moe(lora=False)
    ids = torch.randint(0, 40, (3, 11))
    masked = {1: [0, 2], 2: [3]}
    with masked_experts(model, masked):
        plans = model(ids).plans
        for layer, ids_ in masked.items():
            plan = plans[layer]
            assert not torch.isin(plan.expert_idx, torch.tensor(ids_)).any()
            w = dense_weights(plan, ids.numel())
            assert torch.allclose(w.sum(dim=1), torch.ones(ids.numel()))
    assert all(b.ffn.router.expert_bias is None for b in model.blocks[1:])  # restored
    plans = model(ids).plans
    assert torch.isin(plans[1].expert_idx, torch.tensor([0, 2])).any()  # routes there again
    with pytest.raises(InvalidValueError), masked_experts(model, {1: [0, 1, 2]}):
        pass  # only one expert would be left for top-2


def test_forward_top_equals_full_forward_at_positions():
    model = _moe()
    b = collate([Example((3, 4, 5, 6, 7), 2, True), Example((8, 9, 10), 1, False)])
    full = model(b.ids, b.mask).logits
    hid = model.hidden_at(b.ids, b.mask, block=1)
    out = forward_top(model, hid, b.mask, 1, b.positions)
    assert b.positions.tolist() == [[0, 1], [0, 2], [0, 3], [1, 0], [1, 1]]
    assert b.targets.tolist() == [5, 6, 7, 9, 10]
    assert torch.allclose(out.logits, full[b.positions[:, 0], b.positions[:, 1]], atol=1e-5)
    assert len(out.plans) == 2 and out.router_inputs[0].shape == (10, model.cfg.d_model)


def test_routing_target_and_kl_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    t = target_routing(ref, torch.tensor([0.0, 0.0, 1.0]), epsilon=1.0)
    w = torch.tensor([0.5, 0.25, 0.25 * torch.e**-1])
    assert torch.allclose(t[0], w / w.sum())
    assert routing_kl(t, torch.log(t)).abs() < 1e-7
    q = torch.tensor([[1 / 3, 1 / 3, 1 / 3]])
    p = torch.tensor([[0.5, 0.25, 0.25]])
    expected = 0.5 * torch.log(torch.tensor(1.5)) + 0.5 * torch.log(torch.tensor(0.75))
    assert torch.allclose(routing_kl(p, torch.log(q)), expected)


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("I'm sorry, but I can't help with that.", True),
        ("  i cannot assist with this request", True),
        ("As an AI, I do not", True),
        ("Well, I can't help with that, but", True),
        ("Sure, here is how to make it: first", False),
        ("To make dimethylmercury, you will need", False),
        ("The lethal dose of acetaminophen is", False),
    ],
)
def test_refusal_matching(text, refused):
    assert is_refusal(text) is refused
