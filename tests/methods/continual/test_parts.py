"""Heads, the class reservoir and classifier alignment's decay, with hand-computed values."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.continual.align import ClassGaussians, decay_factor
from moelab.methods.continual.heads import CosineHead, PrototypeHead, label_prompt_head
from moelab.methods.continual.learner import cosface
from moelab.methods.continual.replay import ClassReservoir


def test_decay_factor_as_the_authors_floor_division():
    # task 3 of B0-Inc2: known 6, total 8, task_size = -2; t_id = c // -2
    assert decay_factor(0, 6, 8, 3) == pytest.approx(0.9 + 0.1 * 1 / 4)
    assert decay_factor(1, 6, 8, 3) == pytest.approx(0.9)  # 1 // -2 = -1
    assert decay_factor(2, 6, 8, 3) == pytest.approx(0.9)
    assert decay_factor(7, 6, 8, 3) == pytest.approx(0.9 + 0.1 * (-4 + 1) / 4)  # 7 // -2 = -4


def test_gaussian_samples_have_the_fitted_moments():
    g = ClassGaussians()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, generator=gen) @ torch.tensor([[2.0, 0, 0], [1, 1, 0], [0, 0, 0.5]])
    g.fit(x + torch.tensor([1.0, -2.0, 3.0]), torch.zeros(400, dtype=torch.long), [0])
    s = g.sample(0, 20000, 0.5, gen).double()
    torch.testing.assert_close(s.mean(0), 0.5 * g.means[0], atol=0.05, rtol=0)
    cov = torch.cov((x + 0).double().T) + 1e-4 * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(torch.cov(s.T), cov, atol=0.1, rtol=0.05)


def test_cosine_head_grows_and_cosface_is_scaled_ce():
    torch.manual_seed(0)
    head = CosineHead(4)
    head.grow(2)
    head.grow(3)
    x = torch.randn(5, 4)
    out = head(x)
    w = torch.cat([h.weight for h in head.heads])
    ref = (x / x.norm(dim=1, keepdim=True)) @ (w / w.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(out, ref)
    y = torch.tensor([0, 1, 2, 3, 4])
    # margin m: the target cosine lowered by m before the scale
    m = 0.3
    shifted = out.clone()
    shifted[torch.arange(5), y] -= m
    ref_loss = -torch.log_softmax(20 * shifted, -1)[torch.arange(5), y].mean()
    torch.testing.assert_close(cosface(out, y, 20.0, m), ref_loss)


def test_prototype_and_label_prompt_heads():
    head = PrototypeHead(2)
    feats = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]])
    head.add_classes(feats, torch.tensor([0, 0, 1]), [0, 1])
    assert head.prototypes.tolist() == [[2.0, 0.0], [0.0, 2.0]]
    torch.testing.assert_close(
        head(torch.tensor([[1.0, 1.0]])), torch.full((1, 2), 1 / math.sqrt(2))
    )
    with pytest.raises(InvalidValueError, match="expected class 2"):
        head.add_classes(feats, torch.tensor([0, 0, 1]), [3])
    prompts = label_prompt_head(
        lambda t: torch.tensor([[float(len(s)), 1.0] for s in t]), ["ab", "c"], "a {}"
    )
    assert prompts.prototypes.tolist() == [[4.0, 1.0], [3.0, 1.0]]


def test_reservoir_keeps_a_uniform_sample_per_class():
    counts = Counter()
    for seed in range(300):
        r = ClassReservoir(2, seed=seed)
        r.add(range(10), ["a"] * 10)
        r.add(["x"], ["b"])
        assert len(r.items("a")) == 2 and r.items("b") == ["x"] and len(r) == 3
        counts.update(r.items("a"))
    # every one of the 10 items is kept with probability 2/10: 60 of 300 runs each
    assert all(40 <= counts[i] <= 80 for i in range(10))
    with pytest.raises(InvalidValueError, match="per_class"):
        ClassReservoir(0)
