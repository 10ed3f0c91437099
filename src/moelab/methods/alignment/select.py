"""MESA stage 1 on a model: routing statistics on the statistics set, then each arm's
selected experts per MoE layer (:mod:`moelab.methods.alignment.ot` for the maths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.methods.alignment.data import Cached
from moelab.methods.alignment.ot import (
    co_selection_prior,
    expert_scores,
    select_top,
    transport_cost,
    transport_plan,
    usage_percentiles,
)
from moelab.methods.alignment.routing import forward_top, routing_mass, top_choices
from moelab.models.transformer import MoETransformer


@dataclass
class LayerSelection:
    """One MoE layer's stage-1 result: routing mass on safety (``p_safe``) and general
    (``p_gen``) tokens, the normalised ``cost``, the OT ``scores`` and the ``selected`` ids
    (all ``[E]`` float64 except ``selected``)."""

    p_safe: Tensor
    p_gen: Tensor
    cost: Tensor
    scores: Tensor
    selected: list[int]

    def to_json(self) -> dict:
        r = lambda t: [round(float(v), 6) for v in t]  # noqa: E731
        return {
            "p_safe": r(self.p_safe), "p_gen": r(self.p_gen), "cost": r(self.cost),
            "scores": r(self.scores), "selected": self.selected,
        }  # fmt: skip


@torch.no_grad()
def routing_statistics(model: MoETransformer, stat: Cached, start: int, chunk: int = 16):
    """Per MoE layer: ``(p_safe [E], p_gen [E], top choices of safe tokens [T, k])``."""
    mass_s, mass_g, choices = None, None, None
    for i in range(0, len(stat), chunk):
        b, hid = stat.batch(range(i, min(i + chunk, len(stat))))
        out = forward_top(model, hid, b.mask, start, b.positions[:1])
        real = b.mask.reshape(-1)
        safe, gen = b.safe_tokens & real, ~b.safe_tokens & real
        n_s, n_g = int(safe.sum()), int(gen.sum())
        ms = [routing_mass(p, safe) * n_s for p in out.plans]
        mg = [routing_mass(p, gen) * n_g for p in out.plans]
        cs = [top_choices(p, safe) for p in out.plans]
        if mass_s is None:
            mass_s, mass_g, choices = ms, mg, cs
        else:
            mass_s = [a + b_ for a, b_ in zip(mass_s, ms, strict=True)]
            mass_g = [a + b_ for a, b_ in zip(mass_g, mg, strict=True)]
            choices = [torch.cat([a, c]) for a, c in zip(choices, cs, strict=True)]
    return [(s / s.sum(), g / g.sum(), c) for s, g, c in zip(mass_s, mass_g, choices, strict=True)]


def select_experts(
    model: MoETransformer, stat: Cached, start: int, cfg
) -> dict[int, LayerSelection]:
    """Stage 1 for the arm ``cfg.arm`` (an :class:`AlignConfig`): MoE block index →
    :class:`LayerSelection`. ``all`` selects every expert; ``mesa``/``ot_only`` the top-w OT
    scores; ``max_cost`` the w most expensive experts."""
    layers = [i for i, b in enumerate(model.blocks) if b.is_moe and i >= start]
    out = {}
    for layer, (p_safe, p_gen, choices) in zip(
        layers, routing_statistics(model, stat, start), strict=True
    ):
        E = p_safe.numel()
        cost = transport_cost(usage_percentiles(0.5 * (p_safe + p_gen)), cfg.cost_alpha)
        prior = co_selection_prior(choices, E)
        scores = expert_scores(transport_plan(p_safe, cost, prior, cfg.epsilon, cfg.rho))
        if cfg.arm == "all":
            selected = list(range(E))
        elif cfg.arm == "max_cost":
            selected = select_top(cost, cfg.w)
        else:
            selected = select_top(scores, cfg.w)
        out[layer] = LayerSelection(p_safe, p_gen, cost, scores, selected)
    return out
