"""MESA stage 2: response-only SFT of the selected experts' adapters (and the routers),
with the OT routing-refinement loss (:mod:`moelab.methods.alignment.routing`).

``L = CE(response tokens) + γ · L_OT`` over the mixed safety and general streams (both get
SFT: the paper's data mix SafeRLHF + UltraFeedback suggests it, unverified [S/I]); L_OT only
in the arms that refine routing (``mesa``, ``max_cost``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from moelab.methods.alignment.data import AlignData
from moelab.methods.alignment.freeze import optimizer_groups, train_only
from moelab.methods.alignment.routing import forward_top, routing_kl, target_routing
from moelab.methods.alignment.select import LayerSelection
from moelab.models.transformer import MoETransformer

REFINES_ROUTING = ("mesa", "max_cost")
TRAINS_ROUTERS = ("mesa", "max_cost", "all")


def align_model(
    model: MoETransformer, data: AlignData, selection: dict[int, LayerSelection], cfg, seed: int
) -> dict[str, float]:
    """Train ``model`` (with adapters) in place for ``cfg.epochs`` epochs over
    ``data.train`` in a seeded order; returns ``train_ce``/``train_ot`` (last-epoch means),
    ``trainable_params`` and ``train_seconds``."""
    t0 = time.perf_counter()
    experts = {layer: s.selected for layer, s in selection.items()}
    handles = train_only(model, experts, routers=cfg.arm in TRAINS_ROUTERS)
    trainable = 0  # adapter rows of the selected experts, plus routers when they train
    for layer, s in selection.items():
        ffn = model.blocks[layer].ffn
        E = ffn.config.router.num_experts
        lora = sum(p.numel() for n, p in ffn.experts.named_parameters() if "lora_" in n)
        trainable += lora * len(s.selected) // E
        trainable += ffn.router.weight.numel() if ffn.router.weight.requires_grad else 0
    refine = cfg.arm in REFINES_ROUTING and cfg.gamma > 0
    ref = {layer: model.blocks[layer].ffn.router.weight.detach().clone() for layer in selection}
    penalty = {
        layer: torch.where(
            torch.isin(torch.arange(s.cost.numel()), torch.tensor(s.selected)), 0.0, s.cost.float()
        )
        for layer, s in selection.items()
    }
    opt = torch.optim.AdamW(optimizer_groups(model, cfg.lora_lr, cfg.router_lr))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    ce_sum = ot_sum = 0.0
    steps = 0
    try:
        for _ in range(cfg.epochs):
            order = torch.randperm(len(data.train), generator=gen).tolist()
            ce_sum = ot_sum = 0.0
            steps = 0
            for i in range(0, len(order), cfg.batch_size):
                b, hid = data.train.batch(order[i : i + cfg.batch_size])
                out = forward_top(model, hid, b.mask, data.start, b.positions)
                ce = F.cross_entropy(out.logits.float(), b.targets)
                loss = ce
                if refine:
                    real = b.mask.reshape(-1)
                    kl = 0.0
                    for layer, plan, x in zip(selection, out.plans, out.router_inputs, strict=True):
                        pen = penalty[layer][None, :] * b.safe_tokens[:, None].float()
                        target = target_routing(x.float() @ ref[layer].T, pen, cfg.epsilon)
                        kl = kl + routing_kl(target[real], plan.logits[real])
                    l_ot = kl / len(selection)
                    loss = ce + cfg.gamma * l_ot
                    ot_sum += float(l_ot.detach())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                ce_sum += float(ce.detach())
                steps += 1
    finally:
        for h in handles:
            h.remove()
        model.eval()
    return {
        "train_ce": ce_sum / max(steps, 1),
        "train_ot": ot_sum / max(steps, 1),
        "trainable_params": float(trainable),
        "train_seconds": time.perf_counter() - t0,
    }
