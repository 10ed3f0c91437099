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
    mask = (
        torch.ones(T, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    )
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


def synthetic_run(num_layers: int = 3, num_experts: int = 4, seed: int = 0):
    """Records of a fake top-2 MoE: 2 batches of (2, 8) tokens with padding, 2 domains.

    Domain-0 tokens prefer experts {0, 1} and domain-1 tokens experts {2, 3}. Returns
    ``(records_by_layer, domains [32], hidden_by_layer, expert_outputs_by_layer)``.
    """
    g = torch.Generator().manual_seed(seed)
    B, S, E = 2, 8, num_experts
    T = B * S
    domains = [torch.randint(0, 2, (T,), generator=g) for _ in range(2)]
    masks = [torch.ones(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool)]
    masks[1][S - 3 : S] = False  # padding at the end of the first sequence of batch 1
    records_by_layer = []
    for _ in range(num_layers):
        recs = []
        for dom, mask in zip(domains, masks, strict=True):
            logits = torch.randn(T, E, generator=g)
            bias = torch.zeros(T, E)
            bias[dom == 0, : E // 2] = 2.0
            bias[dom == 1, E // 2 :] = 2.0
            probs = torch.softmax(logits + bias, -1)
            top = probs.topk(2, -1).indices
            pairs = [(t, int(top[t, j])) for t in range(T) for j in range(2)]
            recs.append(build_record(probs, pairs=pairs, mask=mask, batch_shape=(B, S)))
        records_by_layer.append(recs)
    hidden = [torch.randn(T, 6, generator=g) for _ in range(num_layers)]
    outputs = [torch.randn(E, T, 6, generator=g) for _ in range(num_layers)]
    return records_by_layer, torch.cat(domains), hidden, outputs


@pytest.fixture
def run3():
    return synthetic_run()


@pytest.fixture(scope="session")
def make_synthetic_run():
    return synthetic_run
