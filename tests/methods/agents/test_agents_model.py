"""Stage labels, forced Expert-FT routing, router-only training, the token-MoE router."""

import torch

from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.data import prepare_data
from moelab.methods.agents.model import (
    dense_model,
    stage_routing,
    top1_experts,
    upcycle_agent,
)
from moelab.methods.agents.tokens import IGNORE, collate
from moelab.methods.agents.toy import toy_chains
from moelab.methods.agents.train import phase_loss, train_phase

from ._tiny import TINY

CFG = ComeConfig(**TINY)
DATA = prepare_data(CFG, toy_chains(range(16)))


def test_stage_labels_align_with_the_target_tokens():
    tok = DATA.tokenizer
    step, enc = DATA.train_steps[5], DATA.train[5]
    assert tok.decode(enc.ids[: enc.prompt_len].tolist()) == step.prompt
    for k, (marker, text) in enumerate(
        zip(("<ss>", "<sp>", "<ad>", "<af>"), step.stages, strict=True)
    ):
        ids = enc.ids[enc.stage == k].tolist()
        if k == 3:
            assert ids[-1] == DATA.eot_id
            ids = ids[:-1]
        assert tok.decode(ids).strip() == f"{marker} {text}"
    b = collate([DATA.train[5], DATA.train[0]])
    n = len(enc.ids) - 1
    # position t predicts token t+1: its label is that token's stage (prompt → stage 0)
    assert b.stage[0, :n].tolist() == [max(int(s), 0) for s in enc.stage[1:]]
    assert (b.targets[0, : enc.prompt_len - 1] == IGNORE).all()
    assert b.targets[0, enc.prompt_len - 1 : n].tolist() == enc.ids[enc.prompt_len :].tolist()
    assert (b.stage[0, n:] == IGNORE).all() and not b.mask[0, n:].any()


def test_expert_ft_routing_equals_the_stage_labels_exactly():
    torch.manual_seed(0)
    moe = upcycle_agent(dense_model(CFG, DATA.tokenizer.vocab_size), CFG, seed=0)
    b = collate(DATA.train[:4])
    with stage_routing(moe, b.stage):
        out = moe(b.inputs, mask=b.mask)
    want = b.stage.clamp_min(0).reshape(-1)
    tops = top1_experts(out.plans)
    assert len(tops) == CFG.n_layers
    for top, plan in zip(tops, [p for p in out.plans if p is not None], strict=True):
        assert torch.equal(top, want)
        assert torch.equal(plan.weight, torch.ones_like(plan.weight))  # one expert, weight 1


def test_router_ft_trains_only_the_routers_and_lowers_their_loss():
    torch.manual_seed(0)
    moe = upcycle_agent(dense_model(CFG, DATA.tokenizer.vocab_size), CFG, seed=0)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    b = collate(DATA.train[:16])
    with torch.no_grad():
        start = float(phase_loss(moe, b, "router", CFG))
    train_phase(moe, DATA.train, "router", 40, CFG, torch.Generator().manual_seed(0))
    for n, p in moe.named_parameters():
        assert torch.equal(p, before[n]) != (".router." in n), n
    with torch.no_grad():
        assert float(phase_loss(moe, b, "router", CFG)) < 0.8 * start


def test_token_moe_router_is_unnormalised_and_starts_near_the_dense_model():
    torch.manual_seed(0)
    dense = dense_model(CFG, DATA.tokenizer.vocab_size).eval()
    cfg = ComeConfig(**{**CFG.__dict__, "arm": "token_moe"})
    moe = upcycle_agent(dense, cfg, seed=0).eval()
    assert moe.cfg.moe.router.norm_topk_prob is False
    b = collate(DATA.train[:2])
    with torch.no_grad():
        d, m = dense(b.inputs, mask=b.mask), moe(b.inputs, mask=b.mask)
    weights = [p.weight for p in m.plans if p is not None]
    assert all(((w - 1).abs() < 0.05).all() for w in weights)  # E·p ≈ 1 at the start
    assert (d.logits - m.logits).abs().max() < 0.05 * d.logits.abs().max()
    # the router gets a gradient from the LM loss (it would not with normalised top-1)
    moe.train()
    phase_loss(moe, b, "lm", cfg).backward()
    assert all(r.weight.grad.abs().sum() > 0 for r in [blk.ffn.router for blk in moe.blocks])
