"""Offline evaluation on held-out chain steps: generate chains, score the action and stages,
and measure how well the routers follow the stages.

Metrics (``shared/research/wave3-agents-alignment.md`` §3.4):

* ``action_match``: the generated action type (first word of the decision stage) and action
  function both equal the gold ones (AITZ's action match, with exact element refs);
* ``action_type``: the action type alone;
* ``em/<stage>``: exact match of each stage's text;
* ``alignment``: on teacher-forced gold chains, the share of (MoE layer, chain position) pairs
  whose top-1 expert is the position's output stage (the paper's router–stage alignment);
  MoE models only; ``alignment/<stage>`` per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelab.methods.agents.chain import STAGES, ChainStep, action_type, parse_target
from moelab.methods.agents.model import top1_experts
from moelab.methods.agents.tokens import EncodedChain, collate
from moelab.models import MoETransformer
from moelab.serve.engine import Engine
from moelab.serve.params import SamplingParams


def generate_chains(
    model: MoETransformer,
    prompts: Sequence[Sequence[int]],
    eot_id: int,
    *,
    max_tokens: int = 96,
    temperature: float = 0.0,
    seed: int = 0,
    batch: int = 32,
) -> list[list[int]]:
    """Generated ids after each prompt (up to ``eot_id``, excluded), batched through moelab's
    serving engine; ``temperature`` 0 is greedy, otherwise request i samples with seed
    ``seed + i``."""
    engine = Engine(model, max_batch=batch, max_queue=len(prompts) + 1, track_experts=False)
    room = model.cfg.max_seq_len
    seqs = [
        engine.submit(
            list(p),
            SamplingParams(
                max_tokens=max(1, min(max_tokens, room - len(p))),
                temperature=temperature,
                seed=seed + i,
                stop_ids=(eot_id,),
            ),
        )
        for i, p in enumerate(prompts)
    ]
    while engine.has_work():
        engine.step()
    for s in seqs:
        if s.finish_reason == "error":
            raise RuntimeError(f"generation failed: {s.error}")
    return [list(s.output_ids) for s in seqs]


def score_chains(generated: Sequence[str], gold: Sequence[ChainStep]) -> dict[str, float]:
    """Action match, action-type accuracy and per-stage exact match of generated chain text
    against the gold steps (fractions in [0, 1])."""
    n = len(gold)
    match = kind = 0
    em = dict.fromkeys(STAGES, 0)
    for text, step in zip(generated, gold, strict=True):
        got = parse_target(text)
        for name, want in zip(STAGES, step.stages, strict=True):
            em[name] += got.get(name) == want
        same_type = action_type(got.get("decision", "")) == action_type(step.decision)
        kind += same_type
        match += same_type and got.get("function") == step.function
    out = {"action_match": match / n, "action_type": kind / n}
    out.update({f"em/{k}": v / n for k, v in em.items()})
    return out


@torch.no_grad()
def router_alignment(
    model: MoETransformer, chains: Sequence[EncodedChain], batch: int = 32
) -> dict[str, float]:
    """Router–stage alignment on teacher-forced chains (see the module docstring); ``{}`` for
    a dense model."""
    if not model.cfg.moe:
        return {}
    model.eval()
    hit = torch.zeros(len(STAGES))
    count = torch.zeros(len(STAGES))
    for i in range(0, len(chains), batch):
        b = collate(chains[i : i + batch])
        out = model(b.inputs, mask=b.mask)
        stage = b.stage.reshape(-1)
        keep = b.chain.reshape(-1)
        for top in top1_experts(out.plans):
            s = stage[keep]
            ok = (top[keep] == s).float()
            hit += torch.zeros(len(STAGES)).index_add_(0, s, ok)
            count += torch.bincount(s, minlength=len(STAGES)).float()
    out = {"alignment": float(hit.sum() / count.sum())}
    for k, name in enumerate(STAGES):
        out[f"alignment/{name}"] = float(hit[k] / count[k].clamp_min(1))
    return out


def evaluate_offline(
    model: MoETransformer,
    tokenizer,
    eot_id: int,
    steps: Sequence[ChainStep],
    chains: Sequence[EncodedChain],
) -> dict[str, float]:
    """Greedy chains on held-out steps scored (:func:`score_chains`) plus the alignment."""
    prompts = [c.ids[: c.prompt_len].tolist() for c in chains]
    outs = generate_chains(model, prompts, eot_id)
    metrics = score_chains([tokenizer.decode(o) for o in outs], steps)
    metrics.update(router_alignment(model, chains))
    return metrics
