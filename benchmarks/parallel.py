"""Expert parallel (EP) vs Head Parallel (HP) on local gloo ranks, and MH-LatentMoE vs MoE, in one run.

1. Bytes each rank sends per MoE layer forward (counted by the dispatchers, self-sends
   excluded) on W=4 ranks, k = 1, 2, 4, 8, with balanced routing (random router and inputs)
   and skewed routing (bias +10 on experts 0 and 1, which live on EP rank 0, of every head).
   EP: MoELayer D=128, E=8 (2 per rank); HP: Multi-Head LatentMoE H=8, d_h=16 (H·d_h = D),
   E=8 per head. Claim (arXiv 2602.04870): HP constant in k and equal across ranks; EP linear
   in k and imbalanced under skew.
2. Training step time with 1, 2 and 4 processes, EP = HP = world, a fixed per-rank batch
   (weak scaling), rounds interleaved. This machine has 2 CPU cores shared with other jobs, so
   more processes cannot run faster: the figure is the communication/synchronisation cost,
   not a speed-up.
3. Validation loss on the mix corpus after equal steps of a standard top-2 MoE and a
   Multi-Head LatentMoE with equal active parameters per token, ``--seeds`` seeds on one
   held-out set (split seed 0), paired Δ per seed with t and bootstrap intervals. The
   standard MoE is the authors' ``MoEEP`` baseline: 2-layer GELU experts, aux-loss-free bias
   balancing, softmax over the selected logits; both arms update their biases at
   γ = 50 × the peak learning rate, as the authors' ``launch_training.py`` does.
4. FSDP2 with expert parallelism on W=4 gloo ranks (EP=2 × DP=2): each rank's expert
   parameter + AdamW-state bytes with the experts replicated over DP and sharded over DP
   (``ExpertParallel(2, fsdp=True)``), and the two runs' losses over the same steps.

    python benchmarks/parallel.py                 # ~25 min on 2 busy cores
    python benchmarks/parallel.py --steps 60 --rounds 1 --seeds 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from _paired import paired_line
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.latent_moe import LatentMoEConfig, MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.models import ModelConfig, MoETransformer, moe_layer_params
from moelab.parallel import ExpertParallel, build_groups, shard_model
from moelab.parallel.launch import spawn_ranks
from moelab.train.config import TrainConfig
from moelab.train.loop import train

D, T_RANK, E = 128, 512, 8


class _Holder(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def _ep_layer(k):
    torch.manual_seed(0)
    cfg = MoEConfig(
        router=RouterConfig(num_experts=E, top_k=k, expert_bias=True),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=64),
    )
    return MoELayer(cfg)


def _hp_layer(k):
    torch.manual_seed(0)
    return MultiHeadLatentMoE(
        LatentMoEConfig(num_heads=8, head_dim=16, num_experts=E, top_k=k, expert_size=64), D
    )


def bytes_worker(rank, world, ks):
    """Bytes this rank sent in one forward of each layer, per (routing, k)."""
    groups = build_groups(world)
    x = torch.randn(T_RANK, D, generator=torch.Generator().manual_seed(rank))
    out = {}
    for routing in ("balanced", "skewed"):
        for k in ks:
            ep, hp = _Holder(_ep_layer(k)), _Holder(_hp_layer(k))
            shard_model(ep, groups)
            shard_model(hp, groups)
            if routing == "skewed":
                ep.layer.router.expert_bias[:2] = 10.0
                hp.layer.expert_bias[:, :2] = 10.0
            with torch.no_grad():
                ep.layer(x)
                hp.layer(x)
            out[routing, k] = (
                ep.layer.dispatcher.stats.per_call[-1],
                hp.layer.head_dispatcher.stats.per_call[-1],
            )
    return out


def _step_model(kind):
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    if kind == "ep":
        moe = MoEConfig(
            router=RouterConfig(num_experts=8, top_k=2),
            experts=ExpertsConfig(hidden_size=64, ffn_hidden_size=64),
        )
        return ModelConfig(moe=moe, **base)
    lat = LatentMoEConfig(num_heads=4, head_dim=16, num_experts=8, top_k=2, expert_size=64)
    return ModelConfig(moe=None, latent_moe=lat, **base)


def step_worker(rank, world, steps, batch=4, seq=64):
    """Median seconds per training step of the EP model and the HP model (EP = HP = world)."""
    out = {}
    for kind in ("ep", "hp"):
        torch.manual_seed(0)
        model = MoETransformer(_step_model(kind))
        parallel = ExpertParallel(world)
        parallel.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        times = []
        for _ in range(steps + 2):
            ids = torch.randint(0, 256, (batch, seq + 1), generator=gen)
            t = time.perf_counter()
            model.loss(ids[:, :-1], ids[:, 1:]).loss.backward()
            parallel.sync_gradients(model)
            parallel.clip_grad_norm(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        out[kind] = statistics.median(times[2:])
    return out


LR = 2e-3
BIAS_RATE = 50 * LR  # the authors' auxfree_update_ratio = 50 × peak lr, in both arms


def quality_configs():
    """The authors' MoEEP baseline (GELU experts) and MH-LatentMoE with equal active
    parameters per token (D=128, 4 layers): 8 GELU experts of 384, top-2 (2·2·128·384 =
    196,608 active expert weights per layer) against 4 heads of 32 with 8 experts of 320 per
    head, top-2, plus fc_mh and fc_mg (4·2·2·32·320 + 2·128·128 = 196,608)."""
    base = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128)
    router = RouterConfig(
        num_experts=8, top_k=2, expert_bias=True, bias_update_rate=BIAS_RATE,
        softmax_before_topk=False,
    )  # fmt: skip
    losses = LossConfig(load_balance="none", z_loss_coeff=0.0)
    experts = ExpertsConfig(hidden_size=128, ffn_hidden_size=384, activation="gelu")
    moe = MoEConfig(router, experts, losses)
    lat = LatentMoEConfig(num_heads=4, head_dim=32, num_experts=8, top_k=2, expert_size=320)
    return ModelConfig(moe=moe, **base), ModelConfig(moe=None, latent_moe=lat, **base)


def memory_worker(rank, world, steps=4):
    """EP=2 × DP=2: this rank's expert bytes and the losses, experts replicated vs sharded."""
    out = {}
    for fsdp in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(_step_model("ep"))
        parallel = ExpertParallel(2, fsdp=fsdp)
        parallel.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, 256, (4, 65), generator=gen)
            loss = model.loss(ids[:, :-1], ids[:, 1:]).loss
            loss.backward()
            parallel.sync_gradients(model)
            parallel.clip_grad_norm(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        out[fsdp] = {"bytes": parallel.expert_state_bytes(model, opt), "losses": losses}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=200, help="training steps per model (part 3)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (part 2)")
    ap.add_argument("--timed-steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the quality comparison (part 3)")
    args = ap.parse_args()
    ks = (1, 2, 4, 8)
    rows = []

    # 1. bytes per rank per layer
    per_rank = spawn_ranks(bytes_worker, 4, ks=ks)
    ep1 = {}
    for routing in ("balanced", "skewed"):
        for k in ks:
            ep = [r[routing, k][0] for r in per_rank]
            hp = [r[routing, k][1] for r in per_rank]
            ep1.setdefault(routing, statistics.mean(ep))
            rows.append(
                [
                    f"KiB sent/rank/layer, {routing}",
                    f"k={k}, W=4",
                    f"{statistics.mean(ep) / 1024:.1f} (max/min {max(ep) / max(min(ep), 1):.2f}, "
                    f"×{statistics.mean(ep) / ep1[routing]:.2f} vs k=1)",
                    f"{statistics.mean(hp) / 1024:.1f} (max/min {max(hp) / min(hp):.2f})",
                    f"{statistics.mean(ep) / statistics.mean(hp):.2f}",
                ]
            )

    # 2. step time, interleaved rounds
    times: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for _ in range(args.rounds):
        for world in (1, 2, 4):
            res = spawn_ranks(step_worker, world, steps=args.timed_steps)
            times[world].append({k: max(r[k] for r in res) for k in ("ep", "hp")})

    def fmt(world, kind):
        vals = [t[kind] * 1000 for t in times[world]]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        tok = world * 4 * 64 / (statistics.mean(vals) / 1000)
        return f"{statistics.mean(vals):.0f} ± {sd:.0f} ms ({tok:.0f} tok/s)"

    for world in (1, 2, 4):
        ratio = statistics.mean(t["ep"] for t in times[world]) / statistics.mean(
            t["hp"] for t in times[world]
        )
        rows.append(
            [f"step time, {world} proc", "B=4×64/rank, D=64", fmt(world, "ep"), fmt(world, "hp"),
             f"{ratio:.2f}"]
        )  # fmt: skip

    # 3. quality at equal active parameters
    moe_cfg, lat_cfg = quality_configs()
    active = (
        moe_layer_params(moe_cfg.moe)["active_per_token"],
        lat_cfg.latent_moe.active_params(128),
    )
    losses: dict[str, list[float]] = {"MoEEP (GELU)": [], "MH-LatentMoE": []}
    for seed in range(args.seeds):
        cfg = TrainConfig(
            data="mix", steps=args.steps, batch_size=8, seq_len=128, warmup_steps=20, lr=LR,
            eval_every=10**9, checkpoint_every=0, log_every=50, eval_tokens=16384, seed=seed,
            split_seed=0,
        )  # fmt: skip
        for name, model_cfg in zip(losses, (moe_cfg, lat_cfg), strict=True):
            with tempfile.TemporaryDirectory() as tmp:
                res = train(copy.deepcopy(model_cfg), cfg, tmp, progress=False)
                losses[name].append(res.final_eval.overall.loss)
    a, b = (losses[k] for k in losses)
    rows.append(
        [
            "val loss, mix (nats/token)",
            f"{args.steps} steps × 8×128 tok, {args.seeds} seeds, active {active[0]} vs {active[1]}",
            f"{statistics.fmean(a):.4f}",
            f"{statistics.fmean(b):.4f}",
            f"{statistics.fmean(a) / statistics.fmean(b):.3f}",
        ]
    )
    paired = paired_line(b, a)  # MH-LatentMoE − MoEEP, seed by seed

    # 4. FSDP2 on the experts, EP=2 × DP=2
    mem = spawn_ranks(memory_worker, 4)
    rep = [r[False]["bytes"] for r in mem]
    shd = [r[True]["bytes"] for r in mem]
    gap = max(
        abs(x - y) / abs(y)
        for r in mem
        for x, y in zip(r[True]["losses"], r[False]["losses"], strict=True)
    )
    rows.append(
        [
            "expert params + AdamW state / rank",
            "W=4: EP=2 × DP=2, FSDP2 on experts vs replicated",
            f"{statistics.fmean(rep) / 1024:.1f} KiB replicated",
            f"{statistics.fmean(shd) / 1024:.1f} KiB sharded",
            f"{statistics.fmean(rep) / statistics.fmean(shd):.2f} (max rel. loss gap {gap:.1e})",
        ]
    )

    print(
        f"torch {torch.__version__}, gloo on CPU, {torch.get_num_threads()} threads in the parent"
    )
    print("| quantity | setting | EP / standard MoE | HP / MH-LatentMoE | EP÷HP |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\nval loss, MH-LatentMoE − MoEEP (GELU), paired by seed: {paired}")


if __name__ == "__main__":
    main()
