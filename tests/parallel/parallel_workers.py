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


# ---------------------------------------------------------------- training under EP × DP
def tiny_lm_config(num_experts=4, latent=False, bias=False):
    from moelab.core.latent_moe import LatentMoEConfig
    from moelab.models import ModelConfig

    base = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, init_std=0.1)
    if latent:
        lat = LatentMoEConfig(
            num_heads=4,
            head_dim=4,
            num_experts=4,
            top_k=2,
            expert_size=8,
            init_std=0.1,
            bias_update_rate=0.1,
        )
        return ModelConfig(moe=None, latent_moe=lat, **base)
    moe = MoEConfig(
        router=RouterConfig(
            num_experts=num_experts, top_k=2, expert_bias=True, bias_update_rate=0.01
        ),
        experts=ExpertsConfig(hidden_size=16, ffn_hidden_size=8, bias=bias),
        losses=LossConfig(load_balance="global", aux_loss_coeff=0.1, z_loss_coeff=0.01),
    )
    return ModelConfig(moe=moe, **base)


def batch(step: int, rank: int, B: int = 2, S: int = 12):
    """A learnable stream: ``x_{t+1} = (3·x_t + 1) mod 40`` from a random start."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 40, (B, 1), generator=g)
    cols = [x]
    for _ in range(S):
        cols.append((3 * cols[-1] + 1) % 40)
    ids = torch.cat(cols, 1)
    return ids[:, :-1], ids[:, 1:]


def train_steps(model, steps, world, rank, parallel=None):
    """Plain AdamW steps; returns the global mean loss of every step."""
    from moelab.core.routers import update_expert_bias
    from moelab.train.loop import moe_layers

    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=False)
    losses = []
    for step in range(steps):
        if parallel is None:  # single process: the concatenation of every rank's batch
            parts = [batch(step, r) for r in range(world)]
            ids, tgt = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        else:
            ids, tgt = batch(step, rank)
        out = model.loss(ids, tgt)
        out.loss.backward()
        if parallel is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            parallel.sync_gradients(model)
            parallel.clip_grad_norm(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        records = [r for r in out.output.records if r is not None]
        for layer, rec in zip(moe_layers(model), records, strict=True):
            update_expert_bias(layer.router, rec.counts)
            layer.reset_loss_state()
        for m in model.modules():
            if hasattr(m, "update_bias"):
                m.update_bias()
        loss = out.loss.detach().clone()
        if parallel is not None:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses, opt


def ep_dp_training(rank, world, ep, fsdp=(False,), latent=False, steps=20):
    """Train one model per entry of ``fsdp``; returns their losses and rank 0's full state."""
    from moelab.models import MoETransformer
    from moelab.parallel import ExpertParallel

    runs = []
    for use_fsdp in fsdp:
        torch.manual_seed(0)
        model = MoETransformer(tiny_lm_config(latent=latent)).double()
        parallel = ExpertParallel(ep, fsdp=use_fsdp)
        parallel.prepare(model)
        losses, _ = train_steps(model, steps, world, rank, parallel)
        full = parallel_full_state(model, parallel)
        runs.append({"losses": losses, "state": full if rank == 0 else None})
    return runs


def expert_memory(rank, world, ep, steps=4):
    """Replicated vs FSDP2-sharded experts at EP=``ep``: this rank's expert parameter +
    AdamW-state bytes after ``steps`` steps, the losses and rank 0's full state."""
    from moelab.models import MoETransformer
    from moelab.parallel import ExpertParallel

    out = {}
    for use_fsdp in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(tiny_lm_config()).double()
        parallel = ExpertParallel(ep, fsdp=use_fsdp)
        parallel.prepare(model)
        losses, opt = train_steps(model, steps, world, rank, parallel)
        full = parallel_full_state(model, parallel)  # collective: on every rank
        out[use_fsdp] = {
            "bytes": parallel.expert_state_bytes(model, opt),
            "losses": losses,
            "state": full if rank == 0 else None,
        }
    return out


def parallel_full_state(model, parallel):
    from moelab.parallel import full_state_dict

    return full_state_dict(model, parallel.sharded, parallel.groups)


def frozen_through_sharding(rank, world):
    """LoRA-frozen experts (with biases) and a frozen MH-LatentMoE router, sharded over EP =
    ``world``: trainability per name before and after, and the full state after 3 steps."""
    from moelab.models import MoETransformer
    from moelab.models.lora import add_expert_lora, freeze_all_but_lora
    from moelab.parallel import ExpertParallel

    torch.manual_seed(0)
    model = add_expert_lora(MoETransformer(tiny_lm_config(bias=True)).double(), 2)
    freeze_all_but_lora(model)  # as moelab train --lora-rank: freeze first, shard after
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallel = ExpertParallel(world)
    parallel.prepare(model)
    after = {n: p.requires_grad for n, p in model.named_parameters()}
    train_steps(model, 3, world, rank, parallel)
    torch.manual_seed(0)
    latent = MoETransformer(tiny_lm_config(latent=True)).double()
    for n, p in latent.named_parameters():
        p.requires_grad_(not n.endswith("ffn.router"))
    latent_before = {n: p.requires_grad for n, p in latent.named_parameters()}
    ExpertParallel(world).prepare(latent)
    return {
        "before": before,
        "after": after,
        "start": start,
        "end": parallel_full_state(model, parallel),
        "latent_before": latent_before,
        "latent_after": {n: p.requires_grad for n, p in latent.named_parameters()},
    }


# ------------------------------------------------------------------ sharded checkpoints
def save_at(rank, world, ep, folder, fsdp=False):
    from moelab.models import MoETransformer
    from moelab.parallel import ExpertParallel

    torch.manual_seed(0)
    model = MoETransformer(tiny_lm_config())
    parallel = ExpertParallel(ep, fsdp=fsdp)
    parallel.prepare(model)
    _, opt = train_steps(model, 2, world, rank, parallel)
    parallel.save_checkpoint(folder, model, opt, {"step": 2}, 2)
    return _full_model_and_optim(model, opt, parallel)


def load_at(rank, world, ep, folder):
    from moelab.models import MoETransformer
    from moelab.parallel import ExpertParallel

    torch.manual_seed(123)  # other weights: everything must come from the checkpoint
    model = MoETransformer(tiny_lm_config())
    parallel = ExpertParallel(ep)
    parallel.prepare(model)
    from moelab.parallel.checkpoint import latest_sharded_dir, load_sharded

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = latest_sharded_dir(folder)
    state = load_sharded(ckpt, model, parallel.sharded, parallel.groups, opt)
    out = _full_model_and_optim(model, opt, parallel)
    out["trainer_state"] = state
    return out


def _full_model_and_optim(model, opt, parallel):
    from moelab.parallel.shard import full_tensor

    keep = set(parallel.sharded)
    avg = {
        n: full_tensor(opt.state[p]["exp_avg"], n, keep, parallel.groups)
        for n, p in model.named_parameters()
    }
    return {"model": parallel_full_state(model, parallel), "exp_avg": avg}


# ------------------------------------------------------------------------ Head Parallel
def hp_send_sizes(rank, world, ks=(1, 2, 4, 8)):
    """Per k: bytes this rank sent in one MH-LatentMoE forward under HP with routing skewed
    toward experts 0 and 1 of every head, and the HP-vs-local differences of y and dx."""
    from moelab.core.latent_moe import LatentMoEConfig, MultiHeadLatentMoE

    groups = build_groups(world)
    out = {}
    for k in ks:
        torch.manual_seed(0)
        cfg = LatentMoEConfig(num_heads=8, head_dim=4, num_experts=8, top_k=k, expert_size=8)
        ref = MultiHeadLatentMoE(cfg, 16).double()
        with torch.no_grad():
            ref.expert_bias[:, :2] = 5.0  # skew: experts 0 and 1 of every head win
        layer = _Wrap(copy.deepcopy(ref))
        shard_model(layer, groups)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
        xr, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_hp = ref(xr), layer.layer(xh)
        (y_ref.square().sum()).backward()
        (y_hp.square().sum()).backward()
        stats = layer.layer.head_dispatcher.stats
        out[k] = {
            "bytes": stats.per_call[-1],
            "metadata": stats.metadata_bytes,
            "y": (y_hp - y_ref).abs().max().item(),
            "dx": (xh.grad - xr.grad).abs().max().item(),
            "heads": layer.layer.num_local_heads,
        }
    return out


# --------------------------------------------------------------- the training loop (CLI)
def write_corpus(folder):
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
    for i in range(4):
        (folder / f"doc{i}.txt").write_text((text * (20 + 5 * i)).replace("fox", f"fox{i}"))
    return folder


def loop_train_config(corpus):
    from moelab.train.config import TrainConfig

    return TrainConfig(
        data=str(corpus), max_bytes_per_domain=None, val_fraction=0.25, seq_len=16,
        batch_size=2, steps=6, warmup_steps=1, eval_every=3, eval_tokens=64,
        checkpoint_every=2, log_every=1, lr=3e-3, seed=0,
    )  # fmt: skip


def loop_train(rank, world, run_dir, corpus, ep, stop_after=None, resume=False, fsdp=False):
    from moelab.models import ModelConfig
    from moelab.parallel import ExpertParallel
    from moelab.train.loop import train

    moe = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2, expert_bias=True, bias_update_rate=0.01),
        experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32),
        losses=LossConfig(load_balance="global"),
    )
    model_cfg = ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, moe=moe
    )
    cfg = None if resume else loop_train_config(corpus)
    result = train(
        None if resume else model_cfg, cfg, run_dir, resume=resume, progress=False,
        stop_after=stop_after, parallel=ExpertParallel(ep, fsdp=fsdp),
    )  # fmt: skip
    return {"step": result.step, "interrupted": result.interrupted}
