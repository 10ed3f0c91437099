"""Aux losses and cross-entropy normalised by the batch's real tokens (OLMo-core's
``loss_div_factor``): micro-batches with different padding sum to the full-batch loss."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.models import ModelConfig, MoETransformer


def _model(load_balance="switch"):
    cfg = ModelConfig.tiny(vocab_size=40, n_layers=2)
    cfg.moe.losses = LossConfig(load_balance=load_balance, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    torch.manual_seed(0)
    return MoETransformer(cfg)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (4, 10), generator=g)
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[0, 7:] = False  # uneven padding: micro-batch 1 has 17 real tokens, 2 has 12
    mask[2, 4:] = False
    mask[3, 2:] = False
    return ids, ids.roll(-1, 1), mask


def test_ce_and_z_loss_of_micro_batches_sum_to_the_full_batch():
    model = _model()
    ids, tgt, mask = _batch()
    full = model.loss(ids, tgt, mask=mask)
    N = mask.sum()
    parts = [
        model.loss(ids[s], tgt[s], mask=mask[s], loss_div_factor=N)
        for s in (slice(0, 2), slice(2, 4))
    ]
    ce = sum(p.ce for p in parts)
    z = sum(p.output.aux_losses["z_loss"] for p in parts)
    assert ce.item() == pytest.approx(full.ce.item(), rel=1e-6)
    assert z.item() == pytest.approx(full.output.aux_losses["z_loss"].item(), rel=1e-6)
    # the usual mean of micro-batch means weighs the padded micro-batch's tokens more
    plain = [model.loss(ids[s], tgt[s], mask=mask[s]) for s in (slice(0, 2), slice(2, 4))]
    assert abs(sum(p.ce for p in plain).item() / 2 - full.ce.item()) > 1e-3


def test_balance_loss_becomes_olmo_core_local_batch_formula():
    torch.manual_seed(0)
    E, k, D, N = 4, 2, 6, 37.0
    layer = MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=E, top_k=k),
            experts=ExpertsConfig(D, 8),
            losses=LossConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01),
        )
    )
    x = torch.randn(2, 5, D)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = layer(x, mask=mask, loss_div_factor=N)
    valid = mask.reshape(-1)
    plan = out.plan
    counts = torch.bincount(plan.expert_idx[valid[plan.token_idx]], minlength=E).float()
    p_mean = plan.probs[valid].mean(0)
    # OLMo-core local_batch: (E/k) · Σ_i count_i · mean_t p_ti / loss_div_factor
    want_lb = 0.1 * (E / k) * (counts * p_mean).sum() / N
    want_z = 0.01 * torch.logsumexp(plan.logits[valid], -1).square().sum() / N
    assert out.aux_losses["load_balance"].item() == pytest.approx(want_lb.item(), rel=1e-5)
    assert out.aux_losses["z_loss"].item() == pytest.approx(want_z.item(), rel=1e-5)
