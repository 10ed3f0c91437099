"""Specialization + cross-layer coupling losses (arXiv 2602.14159) on the real ``mix`` corpus.

Four arms on the same budget (same steps, data order and init per seed): load balancing only;
+ the intra-layer specialization loss (R_sp: cos² over ordered co-activated pairs per token);
+ the cross-layer loss in the Eq. 7 product form (``joint_topk``); + both. Two settings:
fine-grained E=16, k=4 (many co-activated pairs), and the same with a shared expert (the paper
claims both). λ of each loss is chosen by a sweep over ``--sweep`` on a separate seed (99) of
the first setting (lowest validation loss of its single-loss arm), so the table's seeds do not
select their own λ; then every arm runs ``--seeds`` seeds. Every run holds out the same
documents (split seed 0, ``TrainConfig.split_seed``). For each run, on the same validation
tokens:

- validation bits per byte (``moelab.train.evaluate``);
- mean routing entropy (nats, mean over tokens and MoE layers; ``confidence_stats``);
- co-activated cos²: mean cos² between the SwiGLU activations of the routed expert pairs of
  each token (what R_sp penalises), mean over layers;
- expert-output cosine similarity: every expert run on the same layer inputs (``expert_redundancy``);
- cross-layer pathway consistency: NMI of adjacent layers' top-1 experts (``transitions``).

The paper's claim: lower routing entropy, higher specialization (lower similarity), no worse
loss. Every number is mean ± sd over seeds; below the table every arm is compared with "LB
only" of the same setting and seed as paired differences (mean ± sd, t and bootstrap
intervals, per seed; ``benchmarks/_paired.py``).

Usage::

    python benchmarks/specialization.py                          # sweep + 2 settings × 4 arms × 3 seeds
    python benchmarks/specialization.py --steps 200 --seeds 1 --sweep 0.01   # quick look

The training runs go to ``--workers`` processes of ``--threads`` torch threads each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _paired import paired_block
from _pool import run_jobs
from moelab.analysis import confidence_stats, expert_redundancy, transitions
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.core.losses import coactivated_pairs
from moelab.data import eval_batches, load_tokenizer
from moelab.models import ModelConfig, load_model
from moelab.train.config import TrainConfig
from moelab.train.evaluate import evaluate
from moelab.train.loop import train, validation_streams
from moelab.utils.results import make_result, write_result


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
        pi, pj = coactivated_pairs(rec_tok)
        cos = torch.nn.functional.cosine_similarity(a[pi], a[pj], dim=-1)
        coact[i].append(float(cos.square().mean()) if cos.numel() else 0.0)
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


SEQ_LEN = 128


def model_config(losses: LossConfig, shared: bool) -> ModelConfig:
    """4 layers, D=96, 16 experts of width 96, top-4 (optionally a shared expert of width 96)."""
    return ModelConfig(
        vocab_size=256, d_model=96, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ_LEN,
        moe=MoEConfig(
            router=RouterConfig(num_experts=16, top_k=4),
            experts=ExpertsConfig(
                hidden_size=96, ffn_hidden_size=96, shared_expert_size=96 if shared else 0
            ),
            losses=losses,
        ),
    )  # fmt: skip


def arms(lam_spec: float, lam_cross: float) -> dict[str, LossConfig]:
    spec = dict(specialization=True, specialization_coeff=lam_spec)
    cross = dict(cross_layer=True, cross_layer_coeff=lam_cross, cross_layer_variant="joint_topk")
    return {
        "LB only": LossConfig(),
        "LB + spec": LossConfig(**spec),
        "LB + cross (Eq. 7)": LossConfig(**cross),
        "LB + spec + cross": LossConfig(**spec, **cross),
    }


def run_arm(root: Path, name: str, losses: LossConfig, shared: bool, seed: int, args) -> dict:
    tcfg = TrainConfig(
        data="mix", max_bytes_per_domain=400_000, seq_len=SEQ_LEN, batch_size=8,
        steps=args.steps, lr=3e-3, warmup_steps=30, eval_every=10**6, eval_tokens=1024,
        checkpoint_every=0, log_every=100, seed=seed, split_seed=SPLIT_SEED,
    )  # fmt: skip
    run = (
        root
        / f"{name.replace(' ', '_')}-{shared}-{seed}-{losses.specialization_coeff}-{losses.cross_layer_coeff}"
    )
    t0 = time.time()
    train(model_config(losses, shared), tcfg, run, progress=False)
    model = load_model(run)
    val = validation_streams(tcfg, load_tokenizer(run))
    ev = evaluate(model, val, seq_len=SEQ_LEN, batch_size=16, max_tokens=args.eval_tokens)
    m = routing_metrics(model, val, SEQ_LEN, min(args.eval_tokens, 4096))
    print(f"{run.name}: {time.time() - t0:.0f} s", flush=True)
    return {"bpb": ev.overall.bits_per_byte, "loss": ev.overall.loss, **m}


def mean_sd(values: list[float]) -> str:
    m = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.4f}±{sd:.4f}"


SETTINGS = {"E=16 k=4": False, "E=16 k=4 + shared": True}
SPLIT_SEED = 0  # one held-out set for every seed: differences are paired
SWEEP_SEED = 99  # λ is chosen on a seed the table does not use
SWEPT = {"spec": "LB + spec", "cross": "LB + cross (Eq. 7)"}


def print_table(table: dict, steps: int, seeds: int, chosen: dict) -> None:
    print(
        f"\nSpecialization + cross-layer losses, mix corpus, {steps} steps, {seeds} "
        f"seed(s), λ_spec={chosen['spec']:g}, λ_cross={chosen['cross']:g}; mean ± sd"
    )
    cols = ("bpb", "entropy", "coact_cos2", "expert_cos", "nmi")
    heads = ("val bpb", "entropy", "coact cos²", "expert cos", "pathway NMI")
    print(f"{'setting / arm':<40}" + "".join(f"{h:>16}" for h in heads))
    for key, cell in table.items():
        print(f"{key:<40}" + "".join(f"{mean_sd(cell[c]):>16}" for c in cols))
    for setting in SETTINGS:
        for col, head in zip(cols, heads, strict=True):
            rows = {
                k.split(" / ")[1]: v[col] for k, v in table.items() if k.startswith(setting + " /")
            }
            print(f"\n{setting}, {head}: paired against LB only")
            print("\n".join(paired_block(rows, "LB only", width=38)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sweep", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
    ap.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens/domain")
    ap.add_argument("--workers", type=int, default=2, help="training runs in parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--lambdas", type=float, nargs=2, metavar=("SPEC", "CROSS"),
                    help="skip the sweep and use these coefficients")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the shared result JSON here")
    args = ap.parse_args()
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    done: dict[str, dict] = {}  # every table run's metrics, by config and seed

    def key(losses: LossConfig, shared: bool, seed: int) -> str:
        return f"{losses!r}|{shared}|{seed}"

    # λ per loss: the single-loss arm's lowest validation loss on SWEEP_SEED, E=16 k=4 setting
    chosen = dict(zip(("spec", "cross"), args.lambdas, strict=True)) if args.lambdas else {}
    if not args.lambdas:
        sweep = [(loss, lam, arms(lam, lam)[SWEPT[loss]]) for loss in SWEPT for lam in args.sweep]
        rows = run_jobs(
            [(run_arm, (root, f"sweep-{loss}", cfg, False, SWEEP_SEED, args))
             for loss, lam, cfg in sweep],
            args.workers, args.threads,
        )  # fmt: skip
        scores: dict[str, dict[float, float]] = {loss: {} for loss in SWEPT}
        for (loss, lam, _), row in zip(sweep, rows, strict=True):
            scores[loss][lam] = row["loss"]
        for loss in SWEPT:
            chosen[loss] = min(scores[loss], key=scores[loss].get)
            print(f"sweep {loss}: " + ", ".join(f"λ={k:g}: {v:.4f}" for k, v in scores[loss].items())
                  + f" -> λ={chosen[loss]:g}", flush=True)  # fmt: skip
    cells = [
        (setting, name, losses, shared, seed)
        for setting, shared in SETTINGS.items()
        for name, losses in arms(chosen["spec"], chosen["cross"]).items()
        for seed in range(args.seeds)
    ]
    # the loss arms are the slow ones: start them first
    todo = sorted(
        cells,
        key=lambda c: -(c[2].specialization + c[2].cross_layer),
    )
    rows = run_jobs(
        [(run_arm, (root, name, losses, shared, seed, args)) for _, name, losses, shared, seed in todo],
        args.workers, args.threads,
    )  # fmt: skip
    for (_, _, losses, shared, seed), row in zip(todo, rows, strict=True):
        done[key(losses, shared, seed)] = row
    table: dict[str, dict[str, list[float]]] = {}
    for setting, name, losses, shared, seed in cells:
        cell = table.setdefault(f"{setting} / {name}", {})
        for k, v in done[key(losses, shared, seed)].items():
            cell.setdefault(k, []).append(v)
    if args.json is not None:
        metrics = {
            arm: {seed: {m: vals[seed] for m, vals in cell.items()} for seed in range(args.seeds)}
            for arm, cell in table.items()
        }
        pairs = [
            (arm, f"{arm.split(' / ')[0]} / LB only")
            for arm in table
            if not arm.endswith("LB only")
        ]
        config = {"steps": args.steps, "seeds": args.seeds, "sweep": args.sweep,
                  "eval_tokens": args.eval_tokens, "lambdas": chosen}  # fmt: skip
        write_result(make_result("specialization", "specialization_losses", config, metrics,
                                 pairs=pairs), args.json)  # fmt: skip
    print_table(table, args.steps, args.seeds, chosen)
    print(f"total time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
