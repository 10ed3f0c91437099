"""Specialization + cross-layer dependency losses (arXiv 2602.14159) on the real ``mix`` corpus.

Three runs from one seed on the same budget (same steps, data order and init): load balancing
only; + the intra-layer specialization loss; + both (specialization and cross-layer pathway
loss). For each, on the same validation tokens:

- validation bits per byte (``moelab.train.evaluate``);
- mean routing entropy (nats, mean over tokens and MoE layers; ``confidence_stats``);
- expert-output cosine similarity: every expert run on the same layer inputs, token-wise
  cosine averaged over tokens and expert pairs (``expert_redundancy``), mean over layers;
- co-activated activation cos²: the quantity the specialization loss penalises (mean over the
  routed expert pairs of each token, mean over layers);
- cross-layer pathway consistency: NMI of adjacent layers' top-1 experts (``transitions``),
  mean over the L−1 pairs.

The paper's claim: lower routing entropy and lower expert similarity with the losses, with
validation loss no worse than 1% above the baseline.

Usage::

    python benchmarks/specialization.py               # 3 runs, ~10-12 min on 2 cores
    python benchmarks/specialization.py --steps 60    # quicker, noisier
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from moelab.analysis import confidence_stats, expert_redundancy, transitions
from moelab.core.config import LossConfig
from moelab.core.layer import MoELayer
from moelab.core.losses import specialization_loss
from moelab.data import eval_batches, load_tokenizer
from moelab.models import load_model
from moelab.train.config import TrainConfig
from moelab.train.evaluate import evaluate
from moelab.train.loop import prepare_data, train
from moelab.train.presets import small_model_config


@torch.no_grad()
def routing_metrics(model, val, seq_len: int, tokens_per_domain: int) -> dict[str, float]:
    """Entropy, expert-output similarity, co-activated cos² and pathway NMI on fixed tokens."""
    model.eval()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, kw, out, i=i: inputs[i].append(
                args[0].reshape(-1, args[0].shape[-1])
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    records: list[list] = [[] for _ in layers]
    coact: list[list[float]] = [[] for _ in layers]
    try:
        for stream in val.values():
            for batch in eval_batches(stream, 8, seq_len, tokens_per_domain):
                out = model(batch.input_ids)
                recs = [r for r in out.records if r is not None]
                for i, r in enumerate(recs):
                    records[i].append(r)
    finally:
        for h in hooks:
            h.remove()
    for i, layer in enumerate(layers):
        x = torch.cat(inputs[i])
        rec_tok = torch.cat([r.token_idx + sum(rr.probs.shape[0] for rr in records[i][:j])
                             for j, r in enumerate(records[i])])  # fmt: skip
        rec_exp = torch.cat([r.expert_idx for r in records[i]])
        ex = layer.experts
        a = torch.empty(rec_tok.shape[0], ex.config.ffn_hidden_size)
        for e in range(ex.num_experts):
            sel = rec_exp == e
            a[sel] = ex.activation(x[rec_tok[sel]] @ ex.w_in[e])
        coact[i].append(float(specialization_loss(a, rec_tok, penalty="square")))
    sub = [
        torch.cat(inputs[i])[:: max(1, sum(t.shape[0] for t in inputs[i]) // 2048)] for i in inputs
    ]
    sims = []
    for layer, x in zip(layers, sub, strict=True):
        outs = torch.stack(
            [layer.experts.expert_output(x, e) for e in range(layer.experts.num_experts)]
        )
        sims.append(expert_redundancy(outs).mean_pairwise)
    ent = [confidence_stats(r).entropy for r in records]
    nmi = [t.nmi for t in transitions(records)]
    return {
        "entropy": sum(ent) / len(ent),
        "expert_cos": sum(sims) / len(sims),
        "coact_cos2": sum(c[0] for c in coact) / len(coact),
        "nmi": sum(nmi) / len(nmi),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--coeff", type=float, default=1e-2, help="λ of both new losses")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens/domain")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    lam = args.coeff
    variants = {
        "LB only": LossConfig(),
        "LB + spec": LossConfig(specialization=True, specialization_coeff=lam),
        "LB + spec + cross": LossConfig(
            specialization=True, specialization_coeff=lam, cross_layer=True, cross_layer_coeff=lam
        ),
    }
    root = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    rows = {}
    val = None
    for name, losses in variants.items():
        tcfg = TrainConfig(
            data="mix", max_bytes_per_domain=400_000, seq_len=128, batch_size=16,
            steps=args.steps, lr=3e-3, warmup_steps=10, eval_every=10**6, eval_tokens=1024,
            checkpoint_every=0, log_every=50, seed=args.seed,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        t = time.time()
        res = train(small_model_config(losses), tcfg, root / name.replace(" ", "_"), progress=False)
        run = root / name.replace(" ", "_")
        model = load_model(run)
        if val is None:
            _, _, val = prepare_data(tcfg, load_tokenizer(run))
        ev = evaluate(model, val, seq_len=128, batch_size=16, max_tokens=args.eval_tokens)
        m = routing_metrics(model, val, 128, min(args.eval_tokens, 4096))
        rows[name] = {"bpb": ev.overall.bits_per_byte, "loss": ev.overall.loss, **m}
        print(f"{name}: {res.step} steps, {time.time() - t:.0f} s", flush=True)
    base = rows["LB only"]
    print(
        f"\nSpecialization + cross-layer losses (λ = {lam:g}), mix corpus, {args.steps} steps, "
        f"seed {args.seed}, E=8 k=2 L=4 D=128"
    )
    cols = ("val bpb", "Δ loss %", "entropy", "expert cos", "coact cos²", "NMI")
    print(f"{'run':<20}" + "".join(f"{c:>12}" for c in cols))
    print("-" * (20 + 12 * len(cols)))
    for name, r in rows.items():
        dl = 100 * (r["loss"] / base["loss"] - 1)
        vals = (r["bpb"], dl, r["entropy"], r["expert_cos"], r["coact_cos2"], r["nmi"])
        print(f"{name:<20}" + "".join(f"{v:>12.4f}" for v in vals))
    full = rows["LB + spec + cross"]
    print(
        f"\nclaim check (LB+spec+cross vs LB only): entropy "
        f"{100 * (full['entropy'] / base['entropy'] - 1):+.1f}%, expert cos "
        f"{full['expert_cos'] - base['expert_cos']:+.4f}, val loss "
        f"{100 * (full['loss'] / base['loss'] - 1):+.2f}% (claim: lower, lower, <= +1%)"
    )
    print(f"total time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
