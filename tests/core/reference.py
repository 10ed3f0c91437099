"""Slow per-token reference implementations of the MoE layer's maths (float64 loops)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moelab.core.config import RouterConfig


def ref_token_choice(logits, cfg: RouterConfig, bias=None):
    """Per token: list of (expert, weight) selected, in selection order."""
    out = []
    E = logits.shape[1]
    for row in logits.double():
        if cfg.score_func == "softmax":
            scores = torch.softmax(row, 0)
        elif cfg.score_func == "sigmoid":
            scores = torch.sigmoid(row)
        else:  # sqrtsoftplus (DeepSeek-V4): sqrt(log(1 + e^x))
            scores = torch.log1p(torch.exp(row)).sqrt()
        after = cfg.score_func == "softmax" and not cfg.softmax_before_topk
        sel = (row if after else scores).clone()
        if bias is not None:
            sel = sel + bias.double()
        allowed = list(range(E))
        if cfg.n_group is not None:
            size = E // cfg.n_group
            gscore = []
            for g in range(cfg.n_group):
                vals = sorted(sel[g * size : (g + 1) * size].tolist(), reverse=True)
                best = 2 if cfg.group_score == "top2" else cfg.top_k // cfg.topk_group
                gscore.append(sum(vals[: max(1, min(best, size))]))
            groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[: cfg.topk_group]
            allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -sel[e].item())[: cfg.top_k]
        if after:
            z = torch.stack([row[e] for e in chosen])
            w = torch.softmax(z, 0).tolist()
        else:
            w = [scores[e].item() for e in chosen]
            if cfg.norm_topk_prob:
                s = sum(w)
                w = [v / s for v in w]
        w = [v * cfg.routed_scaling_factor for v in w]
        out.append(list(zip(chosen, w, strict=True)))
    return out


def ref_drop(routes, E, capacity, policy):
    """Apply per-expert capacity to per-token routes by a loop over experts."""
    pairs = [(t, e, w, j) for t, r in enumerate(routes) for j, (e, w) in enumerate(r)]
    keep = set()
    for e in range(E):
        mine = [p for p in pairs if p[1] == e]
        if policy == "probs":
            mine.sort(key=lambda p: (-p[2], p[0], p[3]))
        for p in mine[:capacity]:
            keep.add((p[0], p[3]))
    return [[(e, w) for j, (e, w) in enumerate(r) if (t, j) in keep] for t, r in enumerate(routes)]


def ref_capacity(T, k, E, cf):
    return 0 if T == 0 else max(1, min(math.ceil(T * k / E * cf), T))


def ref_expert_choice(logits, k, cf):
    """Per expert: its top-C tokens by softmax score; returns per-token routes."""
    T, E = logits.shape
    probs = torch.softmax(logits.double(), -1)
    C = ref_capacity(T, k, E, cf)
    routes = [[] for _ in range(T)]
    for e in range(E):
        tokens = sorted(range(T), key=lambda t: -probs[t, e].item())[:C]
        for t in tokens:
            routes[t].append((e, probs[t, e].item()))
    return routes


def ref_expert(x, w_in, w_down, activation):
    h = x @ w_in
    if activation == "swiglu":
        g, u = h.chunk(2, -1)
        h = F.silu(g) * u
    else:
        h = F.gelu(h)
    return h @ w_down


def ref_layer(layer, x, routes):
    """Σ_routes w · expert_e(x_t) per token (+ shared expert), float64."""
    bank = layer.experts
    w_in, w_down = bank.w_in.double(), bank.w_down.double()
    x = x.double().reshape(-1, x.shape[-1])
    out = torch.zeros_like(x)
    for t, r in enumerate(routes):
        for e, w in r:
            out[t] += w * ref_expert(x[t], w_in[e], w_down[e], bank.config.activation)
    se = layer.shared_expert
    if se is not None:
        for t in range(x.shape[0]):
            g, u = (x[t] @ se.w_gate_up.double()).chunk(2, -1)
            y = (F.silu(g) * u) @ se.w_down.double()
            if se.gate is not None:
                y = torch.sigmoid(x[t] @ se.gate.double()[0]) * y
            out[t] += y
    return out


def plan_routes(plan):
    """Per-token sorted (expert, weight) lists from a RoutingPlan, for comparison."""
    routes = [[] for _ in range(plan.num_tokens)]
    for t, e, w in zip(
        plan.token_idx.tolist(), plan.expert_idx.tolist(), plan.weight.tolist(), strict=True
    ):
        routes[t].append((e, w))
    return [sorted(r) for r in routes]
