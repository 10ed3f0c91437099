"""Fixtures: hand-built RoutingRecords for the analysis tests."""

from __future__ import annotations

import pytest
import torch

from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord


def build_record(
    probs,
    pairs=None,
    mask=None,
    batch_shape=None,
    dropped: int = 0,
) -> RoutingRecord:
    """A record from ``probs [T, E]`` and ``pairs`` ``[(token, expert), ...]`` (default: top-1)."""
    probs = torch.as_tensor(probs, dtype=torch.float32)
    T, E = probs.shape
    if pairs is None:
        top1 = probs.argmax(-1)
        pairs = [(t, int(top1[t])) for t in range(T)]
    token_idx = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    expert_idx = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    weight = probs[token_idx, expert_idx] if len(pairs) else torch.zeros(0)
    plan = RoutingPlan(
        token_idx=token_idx,
        expert_idx=expert_idx,
        weight=weight,
        logits=probs.clamp_min(1e-9).log(),
        probs=probs,
        num_experts=E,
        dropped=dropped,
    )
    mask = torch.ones(T, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return RoutingRecord.from_plan(plan, mask, batch_shape or (1, T))


def one_hot_record(experts, num_experts: int, mask=None, batch_shape=None) -> RoutingRecord:
    """Top-1 record whose router puts all mass on ``experts[t]`` for token t."""
    experts = torch.as_tensor(experts, dtype=torch.long)
    probs = torch.nn.functional.one_hot(experts, num_experts).float()
    return build_record(probs, mask=mask, batch_shape=batch_shape)


@pytest.fixture
def make_record():
    return build_record


@pytest.fixture
def make_one_hot():
    return one_hot_record
