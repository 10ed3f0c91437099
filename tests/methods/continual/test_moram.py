"""MoRAM: the self-routed atoms by hand, frozen atoms after a new domain, the untrained learner
equal to the zero-shot encoder, the X-TAIL loss against the authors' formula, the X-TAIL
metrics by hand, the atom-usage diagnostic, and save → load."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.errors import InvalidValueError
from moelab.methods.continual import ContinualConfig, ContinualRecipe
from moelab.methods.continual.io import load_learner, read_run, save_learner
from moelab.methods.continual.loop import StreamResult, run_stream
from moelab.methods.continual.moram_config import MoRAMSettings
from moelab.methods.continual.prompt import xtail_loss
from moelab.models.adapters import MoRAMLinear

from ._tiny import tiny_encoder, tokenize


def _atoms(threshold: float = 0.2, temperature: float = 1.0) -> MoRAMLinear:
    """Two atoms with keys e1 and e2 on a 4 → 3 layer; values b0 = (1, 2, 3), b1 = (-1, 0, 5)."""
    torch.manual_seed(0)
    layer = MoRAMLinear(nn.Linear(4, 3), rank=2, temperature=temperature, threshold=threshold)
    with torch.no_grad():
        layer.lora_A.copy_(torch.eye(4)[:2])
        layer.lora_B.copy_(torch.tensor([[1.0, -1.0], [2.0, 0.0], [3.0, 5.0]]))
    return layer


def test_orthogonal_atom_contributes_exactly_zero_after_the_gate():
    layer = _atoms().eval()
    x = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # orthogonal to atom 0's key
    # ẑ = (0, 1); w = softmax((0, 1)/τ) with τ = 1, then atom 0 gated, no renormalisation
    w1 = math.e / (1 + math.e)
    delta = layer(x) - layer.base(x)
    torch.testing.assert_close(delta, 2.0 * w1 * torch.tensor([[-1.0, 0.0, 5.0]]))
    with torch.no_grad():
        layer.lora_B[:, 0] = 1e6  # atom 0's value cannot leak in
    assert torch.equal(layer(x) - layer.base(x), delta)
    rec = layer.last_record
    assert rec.all_expert_idx.tolist() == [1]
    assert rec.probs[0].tolist() == pytest.approx([0.0, w1])


def test_gate_drops_a_weak_atom_at_eval_only():
    layer = _atoms()
    x = torch.tensor([[0.1, 1.0, 0.0, 0.0]])
    zn = torch.tensor([0.1, 1.0]) / math.sqrt(1.01)  # ẑ0 ≈ 0.0995 < δ = 0.2
    w = torch.softmax(zn, 0)
    b = layer.lora_B.detach()
    train = 0.1 * w[0] * b[:, 0] + 1.0 * w[1] * b[:, 1]
    torch.testing.assert_close((layer.train()(x) - layer.base(x))[0], train)
    torch.testing.assert_close((layer.eval()(x) - layer.base(x))[0], 1.0 * w[1] * b[:, 1])
    assert layer.last_record.all_expert_idx.tolist() == [1]


def test_grow_freezes_old_atoms_as_separate_parameters():
    layer = _atoms()
    A, _ = layer.atoms()
    layer.grow()
    assert layer.num_atoms == 4 and layer.num_frozen == 2
    assert torch.equal(layer.old_lora_A, A) and not layer.old_lora_A.requires_grad
    assert torch.equal(layer.lora_B, torch.zeros(3, 2)) and layer.lora_A.requires_grad
    # the new atoms compete in the top-k: the old atom's weight drops, its value is unchanged
    layer.eval()(torch.tensor([[0.0, 2.0, 0.0, 0.0]]))
    assert layer.last_record.num_experts == 4
    with pytest.raises(InvalidValueError, match="temperature"):
        MoRAMLinear(nn.Linear(4, 3), rank=2, temperature=0.0)


SMALL = dict(
    stream="synthetic-domains",
    scenario="domain",
    train_per_class=4,
    test_per_class=2,
    adapted_blocks=2,
    batch_size=8,
)


def _learner(method: str, encoder=None, **moram):
    settings = MoRAMSettings(**{"rank": 2, "iterations": 4, **moram})
    config = ContinualConfig(**SMALL, method=method, moram=settings)
    recipe = ContinualRecipe(encoder or tiny_encoder(), tokenize)
    torch.manual_seed(0)
    return recipe.learner(config, 0)


@pytest.mark.parametrize("method", ["moram", "prompt-moe-lora"])
def test_frozen_atoms_bit_identical_after_a_new_domain(method):
    learner = _learner(method)
    learner.learn(0)
    before = [tuple(t.detach().clone() for t in _parts(m)) for m in learner.adapters]
    learner.learn(1)
    for m, (A, B) in zip(learner.adapters, before, strict=True):
        assert torch.equal(m.old_lora_A, A) and torch.equal(m.old_lora_B, B)
        assert not m.lora_B.eq(0).all()  # the new atoms did train


def _parts(m):
    return m.atoms() if isinstance(m, MoRAMLinear) else m.experts()


def test_moram_without_trained_atoms_is_the_zero_shot_encoder():
    enc = tiny_encoder()
    moram, zero = _learner("moram", enc), _learner("zeroshot", enc)
    test = list(moram.stream.tasks[0].test) + list(moram.stream.tasks[2].test)
    assert torch.equal(moram.logits(test), zero.logits(test))
    moram.learn(0)
    assert not torch.equal(moram.logits(test), zero.logits(test))


def test_xtail_loss_equals_the_authors_formula():
    torch.manual_seed(1)
    S, C, B, D, s = 3, 4, 6, 5, 100.0
    x, cur, seen = torch.randn(B, D), torch.randn(C, D), torch.randn(S, D)
    y = torch.tensor([0, 2, 2, 3, 1, 2])
    # XTAIL/models/moram.py::train_model: joint [seen; current] space, seen masked to -inf
    out, emb = F.normalize(x, dim=-1), F.normalize(torch.cat([seen, cur]), dim=-1)
    logits = s * out @ emb.T
    logits[:, :S] = float("-inf")
    labels = y + S
    mask = torch.eq(labels[:, None], torch.arange(S + C)[None]).float().T
    ref = F.cross_entropy(logits, labels) + F.cross_entropy(s * emb @ out.T, mask)
    torch.testing.assert_close(xtail_loss(x, cur, y, S, s), ref)


def test_xtail_metrics_by_hand_through_the_stream_result():
    R = np.array([[50.0, 10.0, 20.0], [60.0, 70.0, 30.0], [40.0, 65.0, 80.0]])
    m = StreamResult(R, np.array([50.0, 65.0, 61.0])).metrics()
    assert m["transfer"] == pytest.approx((10.0 + (20.0 + 30.0) / 2) / 2)  # 17.5
    assert m["xtail_average"] == pytest.approx(425.0 / 9)
    assert m["xtail_last"] == pytest.approx((40.0 + 65.0 + 80.0) / 3)


def test_atom_usage_without_gate_counts_top_k_per_token():
    # δ = 0: every token keeps k = min(max(r, 2), N) atoms; after domain 0 all are new
    learner = _learner("moram", threshold=0.0)
    result = run_stream(learner, stop=1)
    usage = learner.atom_usage()
    assert usage["all"]["seen_new"] == 2.0 and usage["all"]["seen_old"] == 0.0
    assert usage["all"]["unseen_new"] == 2.0 and usage["all"]["unseen_none"] == 0.0
    assert set(usage) == {*learner.names, "all"} and len(learner.names) == 2 * 6
    assert result.R.shape == (1, 1)


def test_save_load_mid_stream_same_logits(tmp_path):
    enc = tiny_encoder()
    learner = _learner("moram", enc)
    R = run_stream(learner, stop=2).R
    save_learner(learner, 0, tmp_path / "run", R)
    config, _, n, R_back = read_run(tmp_path / "run")
    assert config == learner.config and n == 2  # the nested settings come back as they were
    # one task per domain (3 here), not config.num_tasks
    assert R_back.shape == (3, 3) and np.array_equal(R_back[:2, :2], R, equal_nan=True)
    assert np.isnan(R_back[2]).all() and np.isnan(R_back[:, 2]).all()
    fresh = _learner("moram", enc)
    load_learner(tmp_path / "run", fresh)
    test = list(learner.stream.tasks[2].test)
    assert torch.equal(fresh.logits(test), learner.logits(test))
    assert all(m.num_frozen == 2 for m in fresh.adapters)


def test_needs_label_prompts():
    with pytest.raises(InvalidValueError, match="label prompts"):
        ContinualRecipe(tiny_encoder(), tokenize).learner(
            ContinualConfig(stream="synthetic", num_classes=6, num_tasks=3, method="moram"), 0
        )
    with pytest.raises(InvalidValueError, match=r"moram\.threshold"):
        MoRAMSettings(threshold=1.5)
    with pytest.raises(InvalidValueError, match="must be a MoRAMSettings, got int"):
        ContinualConfig(moram=8)
    # a saved run's JSON: the nested settings come back as a dict
    assert ContinualConfig(moram={"rank": 4}).moram == MoRAMSettings(rank=4)
