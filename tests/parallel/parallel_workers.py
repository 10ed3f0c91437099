"""Functions that run on every rank of the parallel tests (imported by spawned processes)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.parallel.comm import build_groups
from moelab.parallel.shard import shard_model

D, E, K, T = 16, 8, 2, 24


def _layer(num_experts=E, top_k=K):
    torch.manual_seed(0)
    cfg = MoEConfig(
        router=RouterConfig(num_experts=num_experts, top_k=top_k),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=12, init_std=0.3),
        losses=LossConfig(load_balance="switch", aux_loss_coeff=0.1, z_loss_coeff=0.01),
    )
    return MoELayer(cfg).double()


def _loss(layer, x, w):
    out = layer(x)
    return (out.hidden_states * w).sum() + sum(out.aux_losses.values()), out


class _Wrap(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def ep_forward_backward(rank, world, ep):
    groups = build_groups(ep)
    ref = _layer()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(T, D, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    loss_ref, out_ref = _loss(ref, xr, w)
    loss_ref.backward()
    model = _Wrap(copy.deepcopy(ref))
    model.zero_grad()
    sharded = shard_model(model, groups)
    xe = x.clone().requires_grad_()
    loss_ep, out_ep = _loss(model.layer, xe, w)
    loss_ep.backward()
    n = E // ep
    rows = slice(groups.ep_rank * n, (groups.ep_rank + 1) * n)
    # the shard's owner holds the sum over its EP group of every rank's expert gradient
    expert_ref = {}
    for name, p in ref.experts.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=groups.ep_group)
        expert_ref[name] = g[rows]
    return {
        "out": (out_ep.hidden_states - out_ref.hidden_states).abs().max().item(),
        "dx": (xe.grad - xr.grad).abs().max().item(),
        "router": (model.layer.router.weight.grad - ref.router.weight.grad).abs().max().item(),
        "experts": max(
            (p.grad - expert_ref[name]).abs().max().item()
            for name, p in model.layer.experts.named_parameters()
        ),
        "sharded": sharded,
        "local_experts": model.layer.experts.num_experts,
    }


def remote_zero(rank, world):
    """Zero the experts of every EP rank but rank 0: pairs routed there must give exactly 0."""
    groups = build_groups(world)
    model = _Wrap(_layer())
    shard_model(model, groups)
    if groups.ep_rank != 0:
        with torch.no_grad():
            for p in model.layer.experts.parameters():
                p.zero_()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
    out = model.layer(x)
    plan = out.plan
    plan.weight.retain_grad()
    out.hidden_states.sum().backward()
    local = plan.expert_idx < E // world  # experts of EP rank 0
    remote_tokens = ~local.view(T, K).any(1)
    recv = model.layer.dispatcher.stats
    return {
        "remote_out_max": out.hidden_states[remote_tokens].abs().max().item(),
        "n_remote_tokens": int(remote_tokens.sum()),
        "remote_weight_grad_max": plan.weight.grad[~local].abs().max().item(),
        "local_weight_grad_min": plan.weight.grad[local].abs().min().item(),
        "calls": recv.calls,
    }
