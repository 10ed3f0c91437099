"""CoME's progressive training and the baselines' fine-tuning, on teacher-forced chains.

Phases (``shared/research/wave3-agents-alignment.md`` §3.4):

* ``"lm"``: next-token loss on the chain tokens (the dense warm-up, the dense arm; the token-MoE
  arm adds its layers' balance and z-losses);
* ``"expert"`` (Expert-FT): routing forced to the stage labels by router replay, attention and
  routers frozen [I], LM loss;
* ``"router"`` (Router-FT): only the routers train, on the router cross-entropy against the
  next token's stage, summed over layers [P: routers learn the stage; loss form I];
* ``"cot"`` (CoT-FT): everything trains on LM loss + ``router_ce_coeff`` · router CE +
  ``router_norm_coeff`` · Router-Norm (the router z-loss [I]); the model routes itself.

Each phase builds its own AdamW over the trainable parameters, with 10 warm-up steps and a
cosine decay to 10 % [I].
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Literal

import torch
from torch import Tensor

from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.data import AgentData
from moelab.methods.agents.model import (
    dense_model,
    lm_loss,
    router_cross_entropy,
    router_norm,
    stage_routing,
    upcycle_agent,
)
from moelab.methods.agents.tokens import Batch, EncodedChain, collate
from moelab.models import MoETransformer
from moelab.models.adapters import freeze_except

Phase = Literal["lm", "expert", "router", "cot"]
PHASES = ("lm", "expert", "router", "cot")


def sample_batch(chains: Sequence[EncodedChain], size: int, gen: torch.Generator) -> Batch:
    """``size`` chains of similar length, collated: a random window of ``4·size`` chains in
    length order, then ``size`` draws with replacement inside it (every chain about equally
    likely; padding, which costs compute, falls about twofold on the MiniWoB++ chains) [I]."""
    order = sorted(range(len(chains)), key=lambda i: len(chains[i].ids))
    window = min(len(order), 4 * size)
    start = int(torch.randint(len(order) - window + 1, (1,), generator=gen))
    idx = torch.randint(window, (size,), generator=gen)
    return collate([chains[order[start + int(i)]] for i in idx])


def _set_trainable(model: MoETransformer, phase: Phase) -> None:
    if phase == "router":
        freeze_except(model, ["router"])
    elif phase == "expert":
        for name, p in model.named_parameters():
            p.requires_grad_(".attn." not in name and ".router." not in name)
    else:
        for p in model.parameters():
            p.requires_grad_(True)


def _lr_at(step: int, steps: int, lr: float) -> float:
    warm = min(10, steps)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def phase_loss(model: MoETransformer, batch: Batch, phase: Phase, config: ComeConfig) -> Tensor:
    """The loss of one batch in ``phase`` (see the module docstring)."""
    forced = stage_routing(model, batch.stage) if phase == "expert" else nullcontext()
    with forced:
        out = model(batch.inputs, mask=batch.mask)
    if phase == "router":
        return router_cross_entropy(out.plans, batch.stage, batch.chain)
    loss = lm_loss(out.logits, batch.targets)
    if phase == "lm":
        return loss + out.aux_loss
    if phase == "cot":
        ce = router_cross_entropy(out.plans, batch.stage, batch.chain)
        loss = loss + config.router_ce_coeff * ce
        loss = loss + config.router_norm_coeff * router_norm(out.plans, batch.mask)
    return loss


def train_phase(
    model: MoETransformer,
    chains: Sequence[EncodedChain],
    phase: Phase,
    steps: int,
    config: ComeConfig,
    gen: torch.Generator,
) -> list[float]:
    """Train ``model`` in place for ``steps`` steps of ``phase``; the per-step losses."""
    if steps == 0:
        return []
    _set_trainable(model, phase)
    lr = config.router_lr if phase == "router" else config.lr
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0 if phase == "router" else 0.01)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr)
        loss = phase_loss(model, sample_batch(chains, config.batch_size, gen), phase, config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return losses


def warm_up(config: ComeConfig, data: AgentData, seed: int) -> MoETransformer:
    """The dense warm-up model: initialised from ``seed``, ``warmup_steps`` of LM training."""
    torch.manual_seed(seed)
    model = dense_model(config, data.tokenizer.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    train_phase(model, data.train, "lm", config.warmup_steps, config, gen)
    return model


def train_arm(
    config: ComeConfig, data: AgentData, dense: MoETransformer, seed: int
) -> MoETransformer:
    """Train ``config.arm`` from the warm-up model ``dense`` (not modified); the trained model.

    Every arm draws its batches from a generator seeded with ``seed + 1``, so the arms of one
    seed see the same batches in the same order.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    total = config.expert_steps + config.router_steps + config.cot_steps
    if config.arm == "dense":
        model = copy.deepcopy(dense)
        train_phase(model, data.train, "lm", total, config, gen)
        return model
    model = upcycle_agent(dense, config, seed)
    if config.arm == "token_moe":
        train_phase(model, data.train, "lm", total, config, gen)
        return model
    train_phase(model, data.train, "expert", config.expert_steps, config, gen)
    if config.arm == "come":
        train_phase(model, data.train, "router", config.router_steps, config, gen)
    train_phase(model, data.train, "cot", config.cot_steps, config, gen)
    return model
