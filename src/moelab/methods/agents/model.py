"""The agent LMs: the dense warm-up model, its upcycled MoE forms, and the routing pieces CoME
adds to them (forced stage routing, the router cross-entropy, the Router-Norm term).

CoME's experts share attention and duplicate each layer's FFN channels [S], which is sparse
upcycling of the dense model into four copies with top-1 routing [I]
(:func:`moelab.train.upcycle.upcycle`).
"""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.core.config import LossConfig
from moelab.core.losses.zloss import router_z_loss
from moelab.core.plan import RoutingPlan
from moelab.core.replay import replay_routing
from moelab.core.routers.token_choice import TopKRouter
from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.tokens import IGNORE
from moelab.models import ModelConfig, MoETransformer
from moelab.train.upcycle import upcycle

TOKEN_ROUTER_STD = 2e-3


def dense_model(config: ComeConfig, vocab_size: int) -> MoETransformer:
    """A dense causal LM of ``config``'s size (SwiGLU FFN of width ``ffn_size``)."""
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=config.d_model,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        max_seq_len=config.max_len,
        dense_ffn_size=config.ffn_size,
        moe=None,
    )
    return MoETransformer(cfg)


def upcycle_agent(dense: MoETransformer, config: ComeConfig, seed: int) -> MoETransformer:
    """The dense model upcycled to ``num_experts`` copies with top-1 routing.

    CoME keeps upcycling's normalised weights (one expert per token at weight exactly 1: the
    router only selects) and no balance loss (the stages are not balanced [I]). The token-MoE
    arm's router must learn from the LM loss, so its top-1 weight is the softmax probability
    ``p`` scaled by E (``routed_scaling_factor``) and its router rows start small
    (``TOKEN_ROUTER_STD``), so ``E·p ≈ 1`` at the near-uniform start and the upcycled model
    starts close to the dense one [I]; it has the Switch balance loss.
    """
    token = config.arm == "token_moe"
    losses = LossConfig(
        load_balance="switch" if token else "none",
        aux_loss_coeff=config.balance_coeff if token else 0.0,
        z_loss_coeff=config.router_norm_coeff if token else 0.0,
    )
    with warnings.catch_warnings():
        # upcycling warns that a normalised top-1 router gets no LM gradient: CoME's router is
        # trained by its cross-entropy instead, and the token-MoE arm un-normalises it below
        warnings.filterwarnings("ignore", message="top_k=1 with normalised top-k weights")
        moe = upcycle(
            dense,
            config.num_experts,
            1,
            seed=seed,
            losses=losses,
            router_std=TOKEN_ROUTER_STD if token else None,
        )
    if not token:
        return moe
    # rebuild from a config with the un-normalised router so a saved model reloads as trained
    cfg = moe.cfg
    router = dataclasses.replace(
        cfg.moe.router, norm_topk_prob=False, routed_scaling_factor=float(config.num_experts)
    )
    out = MoETransformer(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router=router)))
    out.load_state_dict(moe.state_dict())
    return out.train(moe.training)


def routers(model: MoETransformer) -> list[TopKRouter]:
    """The token-choice routers of ``model`` in depth order."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def stage_routing(model: MoETransformer, stage: Tensor) -> AbstractContextManager:
    """Route every MoE layer by the stage labels inside the block (Expert-FT).

    Args:
        stage: ``[B, S]`` int64 stage of each position (the expert to use; padding may hold
            any value in ``[0, E)`` or ``IGNORE``, which is sent to expert 0).
    """
    if not routers(model):
        return nullcontext()
    ids = stage.clamp_min(0).reshape(-1, 1)
    names = [n for n, m in model.named_modules() if isinstance(m, TopKRouter)]
    return replay_routing(model, dict.fromkeys(names, ids))


def router_cross_entropy(plans: list[RoutingPlan | None], stage: Tensor, chain: Tensor) -> Tensor:
    """Cross-entropy of each MoE layer's router logits against the stage labels (Router-FT),
    summed over layers; per layer the mean over chain positions plus the mean over the other
    labelled (prompt) positions, so the two-thirds of positions that read the prompt do not
    teach the router to send everything to the summary expert [I].

    Args:
        plans: ``LMOutput.plans`` (None for dense layers). stage: ``[B, S]`` int64 labels,
            ``IGNORE`` where not counted (padding). chain: ``[B, S]`` bool, True where the
            position produces a chain token.
    """
    target = stage.reshape(-1)
    on_chain = chain.reshape(-1)
    groups = [target.masked_fill(~on_chain, IGNORE), target.masked_fill(on_chain, IGNORE)]
    total = torch.zeros((), device=stage.device)
    for plan in plans:
        if plan is None:
            continue
        for t in groups:
            if bool((t != IGNORE).any()):
                total = total + F.cross_entropy(plan.logits, t, ignore_index=IGNORE)
    return total


def router_norm(plans: list[RoutingPlan | None], mask: Tensor) -> Tensor:
    """The Router-Norm term as read here [I]: the router z-loss summed over MoE layers."""
    flat = mask.reshape(-1)
    total = torch.zeros((), device=mask.device)
    for plan in plans:
        if plan is not None:
            total = total + router_z_loss(plan.logits, flat)
    return total


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the counted (chain) targets ``[B, S]``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def top1_experts(plans: list[RoutingPlan | None]) -> list[Tensor]:
    """Each MoE layer's top-1 expert per position (``[T]`` int64; token-major plans)."""
    return [p.expert_idx.view(p.logits.shape[0], -1)[:, 0] for p in plans if p is not None]
