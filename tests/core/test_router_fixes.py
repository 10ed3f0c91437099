"""Issue 9 correctness fixes of the routers, each checked against a float64 reference or a
hand-computed value. Every test here fails on the code before the fix."""

from __future__ import annotations

import warnings

import pytest
import torch

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.losses import switch_balance_loss
from moelab.core.routers import ExpertChoiceRouter, TopKRouter, update_expert_bias
from moelab.models import ModelConfig, MoETransformer, load_model, save_model


def _router_with_logits(cfg: RouterConfig, logits: torch.Tensor) -> TopKRouter:
    """A router whose logits for ``x = I`` are ``logits`` (weight = logitsᵀ rows)."""
    router = TopKRouter(cfg, logits.shape[0])
    with torch.no_grad():
        router.weight.copy_(logits.t())
    return router


# ---------------------------------------------------------------- sigmoid underflow
@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus"])
def test_elementwise_scores_normalise_exactly_when_all_tiny(score_func):
    """Logits around -65 (sigmoid ~ 6e-29): the normalised scores still sum to 1 and the
    balance loss equals the float64 reference (the old eps clamp gave sums of ~1e-8)."""
    torch.manual_seed(0)
    T, E = 5, 4
    logits = -65.0 + torch.randn(T, E)
    if score_func == "sqrtsoftplus":
        logits = logits - 80.0  # softplus(-145) ~ 1e-63 underflows float32 entirely
    cfg = RouterConfig(num_experts=E, top_k=2, score_func=score_func, norm_topk_prob=True)
    router = _router_with_logits(cfg, logits)
    plan = router(torch.eye(T))
    ref = logits.double()
    # float64 reference in log space: log s = logsigmoid(l) or 1/2 log softplus(l) ~ l/2
    log_s = torch.nn.functional.logsigmoid(ref) if score_func == "sigmoid" else 0.5 * ref
    p_ref = log_s.softmax(-1)
    assert torch.allclose(plan.probs.double(), p_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(plan.probs.sum(-1), torch.ones(T), atol=1e-6)
    w = plan.weight.view(T, 2)
    assert torch.allclose(w.sum(-1), torch.ones(T), atol=1e-6)
    idx = plan.expert_idx.view(T, 2)
    w_ref = log_s.gather(1, idx).softmax(-1)
    assert torch.allclose(w.double(), w_ref, rtol=1e-5)
    mask = torch.ones(T, dtype=torch.bool)
    loss = switch_balance_loss(plan.probs, plan.counts(), mask)
    counts = torch.bincount(idx.reshape(-1), minlength=E).double()
    loss_ref = E * ((counts / (2 * T)) * p_ref.mean(0)).sum()
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
    assert loss.item() > 0.5  # a balanced-ish loss is ~1, not ~1e-8


def test_sigmoid_top1_normalised_weight_is_one_for_tiny_scores():
    logits = torch.full((3, 4), -70.0) + torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = RouterConfig(num_experts=4, top_k=1, score_func="sigmoid", norm_topk_prob=True)
        router = _router_with_logits(cfg, logits)
        plan = router(torch.eye(3))
    assert plan.weight.tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------- router state dtype
def test_expert_bias_stays_float32_under_dtype_casts_and_updates_exactly():
    cfg = ModelConfig.tiny(vocab_size=32, n_layers=1)
    cfg.moe.router.expert_bias = True
    model = MoETransformer(cfg)
    router = model.blocks[0].ffn.router
    router.expert_bias.fill_(0.5)
    model.to(torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32
    update_expert_bias(router, torch.tensor([4, 0, 0, 0]), rate=1e-3)  # expert 0 overloaded
    assert router.expert_bias.tolist() == pytest.approx([0.499, 0.501, 0.501, 0.501], abs=1e-7)
    model.half()
    assert router.expert_bias.dtype == torch.float32
    assert router.expert_bias[0].item() == pytest.approx(0.499, abs=1e-7)


def test_expert_bias_stays_float32_through_bf16_save_and_load(tmp_path):
    cfg = ModelConfig.tiny(vocab_size=32, n_layers=1)
    cfg.moe.router.expert_bias = True
    model = MoETransformer(cfg)
    model.blocks[0].ffn.router.expert_bias.fill_(0.5001)
    save_model(model.to(torch.bfloat16), tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.embed.weight.dtype == torch.bfloat16
    bias = loaded.blocks[0].ffn.router.expert_bias
    assert bias.dtype == torch.float32
    assert bias[0].item() == pytest.approx(0.5001, abs=1e-7)


# ---------------------------------------------------------------- top-1 gradient
def test_top1_default_weights_are_unnormalised_and_router_learns_from_task():
    torch.manual_seed(0)
    D = 6
    cfg = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=1),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=8, init_std=0.5),
        losses=LossConfig(load_balance="none", z_loss_coeff=0.0),
    )
    assert cfg.router.norm_topk_prob is False
    layer = MoELayer(cfg)
    x = torch.randn(10, D)
    out = layer(x)
    assert out.aux_losses == {}
    p = out.plan.logits.softmax(-1)
    assert torch.allclose(out.plan.weight, p.max(-1).values)  # Switch: w = p_top1
    out.hidden_states.square().sum().backward()
    assert layer.router.weight.grad.abs().max() > 1e-3


def test_top1_with_normalised_weights_warns():
    with pytest.warns(UserWarning, match="no gradient"):
        RouterConfig(num_experts=4, top_k=1, norm_topk_prob=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RouterConfig(num_experts=4, top_k=2)
        RouterConfig(num_experts=4, top_k=1)


# ---------------------------------------------------------------- padding takes no slot
def _pairs(plan, keep_tokens=None):
    rows = sorted(
        zip(plan.token_idx.tolist(), plan.expert_idx.tolist(), plan.weight.tolist(), strict=True)
    )
    return [(t, e, round(w, 6)) for t, e, w in rows if keep_tokens is None or t in keep_tokens]


@pytest.mark.parametrize("kind", ["expert_choice", "capacity"])
def test_padding_takes_no_expert_slot(kind):
    torch.manual_seed(0)
    E, D, T_real, T_pad = 4, 5, 6, 10
    if kind == "expert_choice":
        cfg = RouterConfig(num_experts=E, top_k=2, kind="expert_choice")
        router = ExpertChoiceRouter(cfg, D, init_std=1.0)
    else:
        cfg = RouterConfig(num_experts=E, top_k=2, capacity_factor=1.0)
        router = TopKRouter(cfg, D, init_std=1.0)
    real = torch.randn(T_real, D)
    # padding rows that would win every expert's top scores
    pad = 10.0 * router.weight.detach().repeat(3, 1)[: T_pad - 0]
    x = torch.cat([real, pad[:T_pad]])
    mask = torch.cat([torch.ones(T_real, dtype=torch.bool), torch.zeros(T_pad, dtype=torch.bool)])
    alone = router(real)
    padded = router(x, token_mask=mask)
    assert _pairs(padded) == _pairs(alone)
    assert all(t < T_real for t in padded.token_idx.tolist())


def test_layer_passes_the_padding_mask_to_the_router():
    torch.manual_seed(0)
    cfg = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2, kind="expert_choice"),
        experts=ExpertsConfig(hidden_size=5, ffn_hidden_size=8),
    )
    layer = MoELayer(cfg)
    real = torch.randn(1, 6, 5)
    x = torch.cat([real, 30.0 * torch.randn(1, 4, 5)], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 4])
    with torch.no_grad():
        a = layer(real).hidden_states
        b = layer(x, mask=mask).hidden_states[:, :6]
    assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------- group score rules
def test_group_score_top2_and_megatron_topk_per_group_differ_as_documented():
    # 2 groups of 4 experts, k=4, topk_group=1: Megatron scores a group by its best
    # k // topk_group = 4 scores, DeepSeek-V3 / transformers by its best 2.
    s = torch.tensor([[0.9, 0.8, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]])
    # top2: group0 = 1.7 > group1 = 1.0 ; top-4 sum: group0 = 1.7 < group1 = 2.0
    logits = s.logit(eps=1e-6)
    for rule, group in (("top2", 0), ("topk_per_group", 1)):
        cfg = RouterConfig(
            num_experts=8, top_k=4, score_func="sigmoid", n_group=2, topk_group=1,
            group_score=rule,
        )  # fmt: skip
        router = _router_with_logits(cfg, logits)
        experts = sorted(router(torch.eye(1)).expert_idx.tolist())
        assert all(e // 4 == group for e in experts), (rule, experts)
