"""SAME's layer (stabilisers by hand values, per-task state, checkpoint safety), its task
prior, and the SAME / MoELoRA / Seq-LoRA learners on a tiny encoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moelab.errors import InvalidValueError
from moelab.methods.continual.config import ContinualConfig
from moelab.methods.continual.io import load_learner, save_learner
from moelab.methods.continual.recipe import ContinualRecipe
from moelab.methods.continual.same import instruction_text, warmup_cosine
from moelab.methods.continual.same_layer import SAMELinear, energy_rank, router_scales
from moelab.methods.continual.same_settings import SAMESettings
from moelab.methods.continual.task_prior import TaskPrior

from ._tiny import tiny_encoder, tokenize


def _layer(E=3, d=6, seed=0, **settings):
    torch.manual_seed(seed)
    s = SAMESettings(rank=6, alpha=12.0, max_components=4, **settings)
    layer = SAMELinear(nn.Linear(d, 5), E, s)
    with torch.no_grad():  # trained-looking experts: gradients of order 1
        layer.lora_A.normal_()
        layer.lora_B.normal_()
    return layer


# -- the stabilisers, by hand ----------------------------------------------------------------
def test_energy_rank_and_router_scales_by_hand():
    S = torch.tensor([4.0, 2.0, 1.0, 0.5])
    # energies 16, 4, 1, 0.25: cumulative ratios .753, .941, .988, 1 → 1 below 0.9, k* = 2
    assert energy_rank(S, 0.9) == 2
    # trailing-3 means 4, 3 → s = 1/4, 1/3 → s/max = .75, 1 → clamped to [0.8, 1.2]
    torch.testing.assert_close(router_scales(S[:2], 3, 0.2), torch.tensor([0.8, 1.0]))


def _with_stats(layer, S):
    d, m = layer.cov_U.shape
    layer.cov_U.copy_(torch.eye(d)[:, :m])
    layer.cov_S.copy_(S)


def test_router_hook_changes_the_gradient_only_inside_the_task_subspace():
    layer = _layer(start_step=0).train()
    _with_stats(layer, torch.tensor([4.0, 2.0, 1.0, 0.5]))
    G = torch.randn(3, 6)
    out = layer._router_hook(G)
    want = G.clone()
    want[:, 0] *= 0.8  # k* = 2 directions e₀, e₁ with c = 0.8, 1.0 (hand values above)
    torch.testing.assert_close(out, want)
    V = torch.eye(6)[:, :2]
    perp = torch.eye(6) - V @ V.T
    assert float(((out - G) @ perp).abs().max()) < 1e-6


def test_router_hook_waits_for_start_step_and_acts_in_backward():
    layer = _layer().train()  # start_step 10
    x = torch.randn(2, 4, 6)
    for step in range(12):
        layer.router.weight.grad = None
        layer(x).sum().backward()
        raw = layer.router.weight.grad.clone()
        if step < 9:  # the hook sees current_step = step + 1 < 10
            continue
        # the recorded gradient is the hook of the raw one: recompute the raw gradient
        layer.settings = dataclasses.replace(layer.settings, router_projection=False)
        layer.current_step -= 1  # replay the same step without the hook
        layer.router.weight.grad = None
        layer(x).sum().backward()
        plain = layer.router.weight.grad.clone()
        layer.settings = dataclasses.replace(layer.settings, router_projection=True)
        k = energy_rank(layer.cov_S, 0.9)
        V = layer.cov_U[:, :k]
        perp = torch.eye(6) - V @ V.T
        assert not torch.allclose(raw, plain)
        assert float(((raw - plain) @ perp).abs().max()) < 1e-6
        return
    raise AssertionError("unreachable")


def test_curvature_hook_by_hand():
    layer = _layer(d=6).train()
    layer.cur_task = 1
    d, m = layer.cov_U_prev.shape
    layer.cov_U_prev.copy_(torch.eye(d)[:, :m])
    layer.cov_S_prev.copy_(torch.tensor([3.0, 1.0, 0.0, 0.0]))
    layer.cov_prev_valid.fill_(True)
    G = torch.randn(3, 2, 6)
    # energies 9, 1: ratios .9, 1 → k* = 2; 1/(3 + .9), 1/(1 + .9) inside, 1/.9 outside
    want = G / 0.9
    want[..., 0] = G[..., 0] / 3.9
    want[..., 1] = G[..., 1] / 1.9
    torch.testing.assert_close(layer._curvature_hook(G), want)
    layer.cur_task = 0  # the first task is never scaled
    assert torch.equal(layer._curvature_hook(G), G)


def test_freezing_rule_by_hand_and_masked_expert_stays_bit_identical():
    layer = _layer(weight_decay=0.0).train()
    layer.begin_task(2)
    layer.utilization.copy_(torch.tensor([0.5, 0.3, 0.2]))
    layer.importance.copy_(torch.tensor([0.1, 0.5, 0.4]))
    # minmax u = 1, 1/3, 0; minmax ι = 0, 1, .75 → scores 1, -2/3, -.75 < 0.1 for experts
    # 1 and 2, but expert 2 is the current task's: only expert 1 is masked
    layer._apply_freezing()
    assert layer.expert_masks.tolist() == [1.0, 0.0, 1.0] and not layer.all_frozen
    layer.settings = dataclasses.replace(layer.settings, freezing=False)  # hold the masks
    A1, B1 = layer.lora_A[1].detach().clone(), layer.lora_B[1].detach().clone()
    A0 = layer.lora_A[0].detach().clone()
    opt = torch.optim.AdamW(
        [layer.lora_A, layer.lora_B, layer.router.weight], lr=1e-2, weight_decay=0.0
    )
    for _ in range(5):
        opt.zero_grad()
        layer(torch.randn(2, 3, 6)).pow(2).sum().backward()
        assert float(layer.lora_A.grad[1].abs().max()) == 0.0
        opt.step()
    assert torch.equal(layer.lora_A[1], A1) and torch.equal(layer.lora_B[1], B1)
    assert not torch.equal(layer.lora_A[0], A0)
    assert layer.last_weights[1] == 0.0


def test_per_task_reset_and_carry():
    layer = _layer().train()
    layer(torch.randn(2, 3, 6))
    assert layer.current_step == 1 and float(layer.cov_S.abs().sum()) > 0
    layer.end_task()
    imp = layer.importance.clone()
    assert bool(layer.cov_prev_valid)
    torch.testing.assert_close(layer.cov_U_prev, layer.cov_U)
    layer.expert_masks.zero_()
    layer.begin_task(1)
    assert layer.current_step == 0 and layer.cur_task == 1 and not layer.all_frozen
    assert layer.expert_masks.tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(layer.utilization, torch.full((3,), 1 / 3))
    assert float(layer.cov_S.abs().sum()) == 0.0  # re-estimated on the next forward
    assert torch.equal(layer.importance, imp) and bool(layer.cov_prev_valid)


def test_range_finder_refresh_interval():
    layer = _layer(refresh_every=3).train()
    seen = []
    for _ in range(7):
        layer(torch.randn(2, 4, 6))
        seen.append(layer.cov_U.clone())
    changed = [i for i in range(1, 7) if not torch.equal(seen[i], seen[i - 1])]
    assert changed == [3, 6]  # forwards with current_step 3 and 6 (0-based counter)
    U = seen[-1]
    torch.testing.assert_close(U.T @ U, torch.eye(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_step_once(reentrant):
    plain, ck = _layer(start_step=0), _layer(start_step=0)
    plain.train(), ck.train()
    for _ in range(3):
        x = torch.randn(2, 4, 6, requires_grad=reentrant)
        torch.manual_seed(1)  # the same range-finder draw for both
        plain(x).sum().backward()
        torch.manual_seed(1)
        checkpoint(ck, x, use_reentrant=reentrant).sum().backward()
    assert plain.current_step == ck.current_step == 3
    torch.testing.assert_close(ck.utilization, plain.utilization)
    for a, b in ((ck.router.weight, plain.router.weight), (ck.lora_A, plain.lora_A)):
        torch.testing.assert_close(a.grad, b.grad)


# -- inference routing and the prior --------------------------------------------------------
def test_inference_topk_with_and_without_prior():
    layer = _layer().eval()
    mean = torch.tensor([[0.5, 0.3, 0.2]])
    torch.testing.assert_close(layer.sparsify(mean, None), torch.tensor([[0.625, 0.375, 0.0]]))
    # the prior disabled is the uniform prior
    torch.testing.assert_close(layer.sparsify(mean, None), layer.sparsify(mean, torch.ones(3)))
    prior = torch.tensor([[0.1, 0.1, 0.8]])  # ⊙ → .05, .03, .16 → top-2 .05, .16
    torch.testing.assert_close(
        layer.sparsify(mean, prior), torch.tensor([[0.05 / 0.21, 0.0, 0.16 / 0.21]])
    )


def test_task_prior_by_hand():
    p = TaskPrior(3, 2)
    p.update(0, torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    p.update(0, torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 4.0]]))
    torch.testing.assert_close(p.text_anchors[0], torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(p.image_anchors[0], torch.tensor([0.0, 2.0]))
    p.update(1, torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    # text (1, 0), image (1, 0): sims 0.8·1 + 0.2·0 = .8, 0.8·0 + 0.2·1 = .2, unseen task 0
    pi = p(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))
    logits = 28 * torch.tensor([0.8, 0.2, 0.0])
    torch.testing.assert_close(pi[0], torch.softmax(logits, 0))
    with pytest.raises(InvalidValueError, match="t: must be in"):
        p.update(3, torch.zeros(1, 2), torch.zeros(1, 2))


def test_warmup_cosine():
    assert warmup_cosine(0, 100, 0.03) == 0.0
    assert warmup_cosine(2, 100, 0.03) == pytest.approx(2 / 3)
    assert warmup_cosine(3, 100, 0.03) == 1.0
    assert warmup_cosine(100, 100, 0.03) == pytest.approx(0.0)


def test_instruction_text_is_stable_and_uses_the_domain():
    a = instruction_text("kjv", "In the beginning")
    assert a == instruction_text("kjv", "In the beginning") and a.endswith(
        " [SEP] In the beginning"
    )
    assert "Bible" in a


# -- learners ---------------------------------------------------------------------------------
CFG = ContinualConfig(
    stream="synthetic-domains",
    scenario="domain",
    train_per_class=6,
    test_per_class=3,
    adapted_blocks=2,
    batch_size=6,
    same=SAMESettings(rank=6, alpha=12.0, start_step=2, refresh_every=2, max_components=8),
)


@pytest.fixture(scope="module")
def recipe():
    return ContinualRecipe(encoder=tiny_encoder(), tokenizer=tokenize)


def test_same_learner_runs_ablation_and_drift(recipe):
    m = recipe.run(dataclasses.replace(CFG, method="same"), 0)
    learner = recipe.learner(dataclasses.replace(CFG, method="same"), 0)
    assert learner.model["prior"].counts.tolist() == [0.0, 0.0, 0.0]
    for key in ("router_drift", "noprior_router_drift"):
        assert 0.0 <= m[key] <= 1.0
    for key in ("route_stability", "noprior_route_stability"):
        assert 0.0 <= m[key] <= 1.0
    assert 0.0 <= m["noprior_last_acc"] <= 100.0 and "noprior_bwt" in m


def test_same_learner_save_load_round_trip(recipe, tmp_path):
    config = dataclasses.replace(CFG, method="same")
    learner = recipe.learner(config, 1)
    learner.learn(0)
    save_learner(learner, 1, tmp_path / "run")
    fresh = recipe.learner(config, 1)
    load_learner(tmp_path / "run", fresh)
    idx = list(learner.stream.tasks[0].test)
    assert torch.equal(learner.logits(idx), fresh.logits(idx))
    layer = fresh.same_layers()[0]
    assert bool(layer.cov_prev_valid)
    assert not any(".base." in k for k in learner.state_dict())


@pytest.mark.parametrize("method", ["moelora", "seqlora"])
def test_baselines_run(recipe, method):
    m = recipe.run(dataclasses.replace(CFG, method=method), 0)
    assert 0.0 <= m["last_acc"] <= 100.0
    assert ("router_drift" in m) == (method == "moelora")


def test_prior_needs_one_expert_per_task(recipe):
    config = dataclasses.replace(CFG, method="same", same=SAMESettings(num_experts=4))
    with pytest.raises(InvalidValueError, match="one expert per task"):
        recipe.learner(config, 0)


def test_config_refuses_a_class_stream_and_reads_settings_back():
    with pytest.raises(InvalidValueError, match="use a domain stream"):
        ContinualConfig(method="same")
    back = ContinualConfig(**dataclasses.asdict(CFG))
    assert back.same == CFG.same
    with pytest.raises(InvalidValueError, match="tau_score"):
        SAMESettings(tau_score="x")
