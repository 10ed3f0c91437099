"""MoE vs its dense twin at equal wall-clock budgets, on the same real data, in one run.

An interleaved probe first times a few training steps of every model (in turn, repeated), so
that each cosine schedule ends at the budget; then each trains (``moelab.train.loop.train``)
and the script prints the validation bits per byte of both, overall and per domain. The dense
twin has one SwiGLU FFN per layer whose width matches the MoE's *active* parameters per token
(``moelab.models.dense_twin``).

Sweeps, all at the first budget: the dense twin trains once per ``--dense-lrs`` value, the
MoE once per ``--shapes`` entry (``E:k:F``, or ``E:k:F+S`` with a shared expert of width S;
all with the same active parameters, so one twin serves them) and ``--moe-lrs`` value; each
side keeps its best run (lowest validation bits/byte), and the later budgets rerun only those
two settings. The twin gets its own learning-rate sweep, so it is not handicapped by the
MoE's rate.

With ``--seeds`` every run is repeated per seed (initialisation, data split and batch order;
the runs go seed by seed, MoE and twin in turn). Each side's best setting is the one with the
lowest mean, and the gap is reported as mean ± sd over the seeds of the paired differences
(dense − MoE at the same seed). With several budgets it also prints the MoE's compute
multiplier: the budget the twin needs to match the MoE's score (``dense_equivalent_budget``,
per seed) over the MoE's budget.

    python benchmarks/moe_vs_dense.py                                  # 2 × 240 s, mix corpus
    python benchmarks/moe_vs_dense.py --budgets 120 240 480 --dense-lrs 1e-3 2e-3 4e-3 \
        --shapes 8:2:384 16:2:384 32:4:192 --json out.json
    python benchmarks/moe_vs_dense.py --budgets 60 --data shakespeare
    python benchmarks/moe_vs_dense.py --budgets 420 --dense-lrs 2e-3 --seeds 0 1 2
    python benchmarks/moe_vs_dense.py --budgets 190 760 --step-times 0.692 0.699 --time-cap 0
    python benchmarks/moe_vs_dense.py --budgets 1520 --step-times 0.692 0.699 --time-cap 0 \
        --device cuda      # a CPU comparison's step counts, trained on a GPU
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moelab.data import sample_batch
from moelab.models import ModelConfig, MoETransformer, count_params, dense_twin_config
from moelab.train.config import TrainConfig
from moelab.train.device import resolve_device
from moelab.train.loop import mixed_precision, prepare_data, train
from moelab.train.optim import build_optimizer
from moelab.train.presets import default_model_config, default_train_dict


def seconds_per_step(
    model_cfgs: dict[str, ModelConfig], cfg: TrainConfig, train_stream, device, rounds: int = 8
) -> dict[str, float]:
    """Median wall time of one optimizer step (forward, backward, AdamW) of every model,
    measured interleaved: ``rounds`` rounds of 3 steps per model in turn, the first round a
    warm-up. Interleaving puts every model under the same machine conditions; timing each
    model just before its own run let a shared machine's drift decide the step counts."""
    gen = torch.Generator().manual_seed(cfg.seed)
    models = {}
    for name, model_cfg in model_cfgs.items():
        torch.manual_seed(cfg.seed)
        model = MoETransformer(model_cfg).to(device)
        models[name] = (model, build_optimizer(model, cfg))  # the loop's own optimizer
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        for name, (model, opt) in models.items():
            for _ in range(3):
                batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, gen).to(device)
                t = time.perf_counter()
                for _ in range(cfg.grad_accum):
                    with mixed_precision(cfg, batch.input_ids.device):
                        loss = model.loss(batch.input_ids, batch.targets).loss
                    loss.backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r:
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_one(name, model_cfg, base, train_stream, budget, lr, root, t_step, cap, device) -> dict:
    """Train ``model_cfg`` at ``lr`` for the steps that fit ``budget`` seconds at ``t_step``
    seconds per step, stopping at ``cap`` × ``budget`` seconds at the latest (0: no cap);
    the result row."""
    cfg = dataclasses.replace(base, lr=lr)
    steps = max(10, int(budget / t_step))
    run_cfg = dataclasses.replace(
        cfg, steps=steps, warmup_steps=max(1, steps // 20), time_budget_s=budget * cap or None
    )
    label = name.replace(" ", "_").replace("/", "-")
    out = root / f"{label}-{budget:g}s-lr{lr:g}-seed{base.seed}"
    result = train(dataclasses.replace(model_cfg), run_cfg, out, progress=False, device=device)
    if result.interrupted:  # SIGINT/SIGTERM: stop the sweep; the run resumes with moelab train
        raise SystemExit(f"{name}: interrupted at step {result.step}; {out} can be resumed")
    ev = result.final_eval
    params = count_params(MoETransformer(model_cfg))
    row = {
        "model": name,
        "budget_s": budget,
        "seed": base.seed,
        "lr": lr,
        "params": params["total"],
        "active": params["active_per_token"],
        "steps": result.step,
        "elapsed_s": result.elapsed_s,
        "tokens": result.step * base.batch_size * base.seq_len,
        "val_bpb": ev.overall.bits_per_byte,
        "per_domain": {d: v.bits_per_byte for d, v in ev.per_domain.items()},
    }
    print(
        f"{name:<13} {budget:5.0f} s  lr {lr:g} seed {base.seed}: {result.step} steps in {result.elapsed_s:.0f} s, "
        f"val bpb {row['val_bpb']:.4f}",
        flush=True,
    )
    return row


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def dense_equivalent_budget(curve: dict[float, float], target: float) -> float | None:
    """The budget (s) at which the twin's validation curve ``{budget: bits/byte}`` reaches
    ``target``: linear in log(budget) between the two measured budgets that bracket it (the
    curve is taken as decreasing). None when ``target`` lies outside the measured range, since
    extrapolating a loss curve is a guess. Divided by the MoE's own budget, this is the MoE's
    compute multiplier over its twin, the scaling-law way of stating the lead: unlike a gap in
    bits/byte, it does not shrink just because both curves flatten."""
    points = sorted(curve.items())
    for (b0, l0), (b1, l1) in itertools.pairwise(points):
        if l1 <= target <= l0 and l0 > l1:
            return b0 * (b1 / b0) ** ((l0 - target) / (l0 - l1))
    return None


def print_table(rows: list[dict], best: dict) -> None:
    """Every run, then per budget each side's best setting (mean ± sd over seeds) and the gap."""
    domains = sorted(rows[0]["per_domain"])
    print(
        f"\n{'budget':>6} {'model':<13} {'lr':>7} {'seed':>4} {'params':>8} {'active':>8} "
        f"{'steps':>6} {'tokens':>8} {'val bpb':>8} " + " ".join(f"{d:>11}" for d in domains)
    )
    for r in rows:
        side = "dense twin" if r["model"] == "dense twin" else "moe"
        mark = "*" if any(r is b for b in best.get((r["budget_s"], side), ())) else " "
        print(
            f"{r['budget_s']:5.0f}s {r['model']:<13} {r['lr']:7.1e} {r['seed']:>4} "
            f"{r['params'] / 1e6:7.2f}M {r['active'] / 1e6:7.2f}M {r['steps']:>6} "
            f"{r['tokens'] / 1e6:7.2f}M {r['val_bpb']:8.4f}{mark}"
            + " ".join(f"{r['per_domain'][d]:11.4f}" for d in domains)
        )
    print("(* = each side's best setting at that budget)")
    for budget in sorted({r["budget_s"] for r in rows}):
        moe, dense = best[(budget, "moe")], best[(budget, "dense twin")]
        m, m_sd = _mean_sd([r["val_bpb"] for r in moe])
        d, d_sd = _mean_sd([r["val_bpb"] for r in dense])
        by_seed = {r["seed"]: r["val_bpb"] for r in moe}
        gaps = [r["val_bpb"] - by_seed[r["seed"]] for r in dense if r["seed"] in by_seed]
        g, g_sd = _mean_sd(gaps)
        print(
            f"{budget:5.0f} s: MoE {m:.4f} ± {m_sd:.4f} vs dense {d:.4f} ± {d_sd:.4f} "
            f"({len(moe)} seeds): MoE ahead by {g:+.4f} ± {g_sd:.4f} bits/byte"
        )
    budgets = sorted({r["budget_s"] for r in rows})
    for budget in budgets:  # one budget: no curve to interpolate, so nothing is printed
        ratios = []
        for r in best[(budget, "moe")]:  # per seed: each seed holds out its own documents
            curve = {b: x["val_bpb"] for b in budgets for x in best[(b, "dense twin")]
                     if x["seed"] == r["seed"]}  # fmt: skip
            needed = dense_equivalent_budget(curve, r["val_bpb"])
            if needed is not None:
                ratios.append(needed / budget)
        if ratios:
            m, sd = _mean_sd(ratios)
            print(
                f"{budget:5.0f} s: the twin needs {m:.2f} ± {sd:.2f}× this budget to match the "
                f"MoE ({len(ratios)} seeds inside its measured budgets)"
            )


def moe_shape(base: ModelConfig, spec: str) -> tuple[str, ModelConfig]:
    """``"E:k:F"`` or ``"E:k:F+S"`` → (a label, ``base`` with E experts, top-k, expert width
    F and an always-on shared expert of width S, DeepSeekMoE-style; default S = 0)."""
    routed, _, shared = spec.partition("+")
    E, k, F = (int(v) for v in routed.split(":"))
    S = int(shared or 0)
    cfg = copy.deepcopy(base)
    cfg.moe.router.num_experts, cfg.moe.router.top_k = E, k
    cfg.moe.experts.ffn_hidden_size = F
    cfg.moe.experts.shared_expert_size = S
    return f"moe {E}x{k}/{F}" + (f"+{S}" if S else ""), cfg


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    preset_train = default_train_dict()
    ap.add_argument("--budgets", type=float, nargs="+", default=[240.0],
                    help="training seconds per model, one comparison per budget")  # fmt: skip
    ap.add_argument("--dense-lrs", type=float, nargs="+", default=None,
                    help="the dense twin's learning rates (default: the preset's)")  # fmt: skip
    ap.add_argument("--moe-lrs", type=float, nargs="+", default=None,
                    help="the MoE's learning rates (default: the preset's)")  # fmt: skip
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="MoE shapes E:k:F or E:k:F+S (S: shared expert width) tried at the first budget (default: the preset's)")  # fmt: skip
    ap.add_argument("--data", default="mix")
    ap.add_argument("--tokenizer", default=preset_train["tokenizer"], choices=["byte", "bpe"],
                    help="both models' tokenizer, trained on the training split (default: moelab train's)")  # fmt: skip
    ap.add_argument("--bpe-vocab-size", type=int, default=preset_train["bpe_vocab_size"])
    ap.add_argument("--max-bytes-per-domain", type=int, default=preset_train["max_bytes_per_domain"],
                    help="cap per corpus domain in bytes (default: moelab train's, the whole corpus)")  # fmt: skip
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="training precision of both models (TrainConfig.precision)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="repeat every run per seed; report mean ± sd")  # fmt: skip
    ap.add_argument("--time-cap", type=float, default=1.15,
                    help="stop a run at this multiple of its budget (0: never; the probe's step count decides). "
                         "A cap cuts runs short when something else shares the cores")  # fmt: skip
    ap.add_argument("--step-times", type=float, nargs="+", default=None,
                    help="seconds per step of each --shapes entry, then of the twin, in place of the probe "
                         "(to extend an earlier comparison at its step counts)")  # fmt: skip
    ap.add_argument("--device", default="cpu",
                    help="where both models train: cpu (the budgets are this machine's seconds), cuda, auto. "
                         "With --step-times from a CPU run, a GPU reruns that run's step counts")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    args = ap.parse_args()

    base = TrainConfig(
        data=args.data,
        tokenizer=args.tokenizer,
        bpe_vocab_size=args.bpe_vocab_size,
        max_bytes_per_domain=args.max_bytes_per_domain,
        precision=args.precision,
        eval_every=10**9,
        checkpoint_every=0,
        log_every=10,
    )
    device = resolve_device(args.device)
    tokenizer, train_stream, _ = prepare_data(base, None)
    preset = default_model_config()
    preset.vocab_size = tokenizer.vocab_size
    r, e = preset.moe.router, preset.moe.experts
    preset_shape = f"{r.num_experts}:{r.top_k}:{e.ffn_hidden_size}+{e.shared_expert_size}"
    shapes = args.shapes or [preset_shape]
    moes = [moe_shape(preset, spec) for spec in shapes]
    dense = dense_twin_config(moes[0][1])
    active = {
        c.moe.router.top_k * c.moe.experts.ffn_hidden_size + c.moe.experts.shared_expert_size
        for _, c in moes
    }
    if len(active) > 1:  # the routers' E·D weights differ a little; the twin is the first's
        raise SystemExit("--shapes: every shape needs the same active expert width k·F + S")
    root = args.out or Path(tempfile.mkdtemp(prefix="moe_vs_dense_"))
    rows: list[dict] = []
    best: dict = {}
    models = {name: cfg for name, cfg in [*moes, ("dense twin", dense)]}
    if args.step_times is None:
        t_step = seconds_per_step(models, base, train_stream, device)
        print("seconds per step (interleaved probe):", {k: round(v, 3) for k, v in t_step.items()})
    elif len(args.step_times) != len(models):
        raise SystemExit(f"--step-times: one per shape and one for the twin ({len(models)})")
    else:
        t_step = dict(zip(models, args.step_times, strict=True))
    for i, budget in enumerate(args.budgets):
        if i == 0:
            trials = [("moe", n, c, lr) for n, c in moes for lr in args.moe_lrs or [base.lr]]
            trials += [
                ("dense twin", "dense twin", dense, lr) for lr in args.dense_lrs or [base.lr]
            ]
        else:
            first = args.budgets[0]
            trials = [(side, *best[(first, side)][0]["setting"]) for side in ("moe", "dense twin")]
        runs: list[list[dict]] = [[] for _ in trials]
        for seed in args.seeds:  # seed-major, sides interleaved, so drift hits both alike
            seeded = dataclasses.replace(base, seed=seed)
            for j, (_, name, cfg, lr) in enumerate(trials):
                row = run_one(
                    name, cfg, seeded, train_stream, budget, lr, root, t_step[name],
                    args.time_cap, device,
                )  # fmt: skip
                row["setting"] = (name, cfg, lr)
                runs[j].append(row)
                rows.append(row)
        for side in ("moe", "dense twin"):
            mine = [rs for rs, trial in zip(runs, trials, strict=True) if trial[0] == side]
            best[(budget, side)] = min(mine, key=lambda rs: _mean_sd([r["val_bpb"] for r in rs]))
        print_table(rows, best)
        if args.json:
            keep = [{k: v for k, v in r.items() if k != "setting"} for r in rows]
            args.json.write_text(json.dumps(keep, indent=1))
    print(
        f"\nMoE vs dense twin, data={args.data}, tokenizer={tokenizer.kind} "
        f"(vocab {tokenizer.vocab_size}), seeds={args.seeds}, runs in {root}"
    )


if __name__ == "__main__":
    main()
