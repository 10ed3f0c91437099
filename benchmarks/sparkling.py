"""SPARKLING mid-training width expansion (arXiv 2602.02472) on the real ``mix`` corpus.

Settings: {dense, MoE} × {2× hidden size, 2× expert inner size, both} with AdamW, plus dense
2× hidden with Muon. Default model: 4 layers of D = 64 (4 heads of 16), MoE 8 experts of F = 64
top-2 (dense FFN 128), byte-level, batch 16 × 128, 1,200 steps with the expansion at step 600
(``--d-model``, ``--layers``, ``--experts``, ``--steps``, ``--expand-at``). Each setting,
3 seeds, compares five runs of ``moelab.train.loop.train`` with the same total steps,
schedule and data order; the (seed, setting) groups run over ``--workers`` processes. The
expansions share the small model's run up to step T_E (stopped there with its checkpoint),
are grown by ``moelab.train.expand_run.expand_run`` (what ``moelab expand`` does;
bit-for-bit the same as an in-loop ``--expand-at T_E``, see tests/train/test_expand.py) and
resumed to the end. Hidden expansion keeps the heads and head_dim (the paper's §3.3), for
every run including scratch:

- ``sparkling``: the paper's method (arXiv 2602.02472 v2): copy-copy initialisation with the
  analytic fan-in scale (½ at 2×, so the grown model computes the same function), old
  entries' optimizer state kept unscaled and new entries' at zero (Eq. 24), and the new
  entries' learning rate re-warmed from the current rate to 1.3× over τ_w steps and back
  onto the base schedule over as many (a short re-warmup, ``rewarm_tail="base"``); τ_w
  defaults to 0.8 % of the remaining steps (the paper's 250 of ≈ 31.8k), i.e. 5 steps here
  (``--rewarm-steps`` overrides);
- ``naive``: default-initialised new entries, symmetric optimizer state (new entries join the
  old step counter with zero moments, no re-warmup);
- ``copy``: plain function-preserving copies (HyperCloning for hidden, Net2Net for the inner
  width), symmetric optimizer state (copied moments), no re-warmup — at 2× the same weights
  as ``sparkling``, so the difference between the two rows is the paper's asymmetric state
  reset and re-warmup;
- ``random``: the random-random ablation (the paper's Fig. 1/6; moelab's earlier reading of
  SPARKLING): random new entries at the old RMS with a fan-in scale fitted on a calibration
  batch, with SPARKLING's asymmetric state and re-warmup;
- ``scratch``: the final width from step 0.

Measured per run (mean ± sd over the seeds):

- spike: max training loss over the 50 steps after the expansion / mean training loss over
  the 20 steps before, minus 1, in %. The ``scratch`` row applies the same windows to the
  from-scratch run (no expansion): that is the noise floor of this statistic on batches of
  this size (+10 to +12 % in the default setting: one batch's loss has a relative sd near
  5 %, three quarters of it within a domain, so larger batches of this corpus barely help);
- probe spike: the same statistic on a fixed probe batch (the first ``PROBE_TOKENS`` of
  every validation domain) scored after every update in the windows (``train(on_step=...)``),
  for the model states that computed those training losses: the grown model before its first
  update, then after each of the next 49. The paper's curves come from batches of millions
  of tokens, where minibatch noise vanishes; a fixed batch removes it at CPU scale [our
  choice]. What is left in the scratch row is the training dynamics' own wobble;
- 1st-step Δ vs copy: training loss of the first step after the expansion (computed before
  any update at the new width, so it is the initialisation's effect alone) relative to the
  copy run's, which equals the unexpanded model's loss on that batch (same batches in every
  run);
- pair cos: mean cosine similarity between each new unit and the old unit it copies
  (``copy``) or its counterpart ``j mod n_old`` (other rows) 200 steps after the expansion —
  residual channels for hidden (and both-axes) expansion, expert/FFN hidden units for inner
  expansion (``moelab.train.expand.counterpart_cosine``); the scratch row is unrelated units,
  the independence reference;
- final validation bits per byte, and its difference from the same seed's scratch run (same
  held-out documents, so this is the paired comparison);
- compute to reach scratch's final loss: training FLOPs (analytic ``6·N_active + 6·L·S·d_attn``
  per token) and wall time until the 20-step rolling training loss first reaches the scratch
  run's final 20-step rolling loss, as a fraction of what scratch needed; ``reached`` counts
  the seeds that got there.

Usage::

    python benchmarks/sparkling.py                 # 7 settings x 5 runs x 3 seeds, ~2 h
    python benchmarks/sparkling.py --steps 250 --expand-at 50 --seeds 1 --settings 3 \
        --d-model 32 --layers 2 --experts 4 --seq-len 64   # quick
    python benchmarks/sparkling.py --methods sparkling,copy,scratch   # a subset of the runs
    python benchmarks/sparkling.py --settings 0,2 --ablation   # which ingredient does what:
        # SPARKLING with symmetric state, with the old state scaled like the weights, and
        # without the LR boost (ρ = 1, τ_w = 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _paired import paired_line
from _pool import run_jobs
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig, count_params, load_model
from moelab.train import loop
from moelab.train.checkpoint import latest_checkpoint_dir
from moelab.train.config import TrainConfig
from moelab.train.evaluate import evaluate
from moelab.train.expand import counterpart_cosine, expanded_config
from moelab.train.expand_run import expand_run
from moelab.train.loop import prepare_data, train
from moelab.train.metrics import MetricsLog
from moelab.utils.results import make_result, write_result

# every run reads the same capped corpus: load it once (identical documents, far less CPU)
loop.load_corpus = functools.lru_cache(maxsize=None)(loop.load_corpus)
PROBE_TOKENS = 2048  # per validation domain

METHODS = {
    "sparkling": {"expand_init": "sparkling", "expand_state": "asymmetric"},
    "naive": {"expand_init": "naive", "expand_state": "symmetric"},
    "copy": {"expand_init": "copy", "expand_state": "symmetric"},
    "random": {"expand_init": "random", "expand_state": "asymmetric"},
    "scratch": None,
}
ABLATIONS = {  # --ablation: which ingredient does what
    "sparkling+sym": {"expand_init": "sparkling", "expand_state": "symmetric"},
    "sparkling+scaled": {"expand_init": "sparkling", "expand_state": "scaled"},
    # the boost isolated: the same state reset with the new entries exactly on the base
    # schedule (ρ = 1 with the short tail), and the earlier reading's own-cosine tail
    "sparkling-noboost": {
        "expand_init": "sparkling", "expand_state": "asymmetric", "rewarm_ratio": 1.0,
        "rewarm_tail": "base",
    },
    "sparkling-owntail": {
        "expand_init": "sparkling", "expand_state": "asymmetric", "rewarm_tail": "own",
    },
}  # fmt: skip
SPLIT_SEED = 0  # one held-out set for every seed: the Δ vs scratch is paired on it
SETTINGS = (
    ("dense", "hidden", "adamw"),
    ("dense", "inner", "adamw"),
    ("moe", "hidden", "adamw"),
    ("moe", "inner", "adamw"),
    ("dense", "hidden", "muon"),
    ("dense", "both", "adamw"),
    ("moe", "both", "adamw"),
)
# (hidden, inner) width factors per axis; "both" is the paper's third axis
FACTORS = {"hidden": (2.0, None), "inner": (None, 2.0), "both": (2.0, 2.0)}
LABELS = {"hidden": "hidden", "inner": "expert", "both": "hidden+expert"}


def setting_label(setting: tuple[str, str, str]) -> str:
    """``("moe", "inner", "adamw")`` → ``"moe expert 2× adamw"`` (table rows, result arms)."""
    kind, axis, opt = setting
    return f"{kind} {LABELS[axis]} 2× {opt}"


def small_config(kind: str, seq_len: int, d_model: int, n_layers: int, experts: int) -> ModelConfig:
    """The model before expansion: ``n_layers`` layers of width ``d_model``, heads of 16
    (half as many KV heads), byte vocabulary; MoE: ``experts`` experts of F = ``d_model``,
    top-2; dense: one SwiGLU FFN of width 2·``d_model`` (the MoE's active width)."""
    heads = max(1, d_model // 16)
    cfg = ModelConfig(
        vocab_size=256,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=max(1, heads // 2),
        max_seq_len=seq_len,
        dense_ffn_size=2 * d_model,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=2),
            experts=ExpertsConfig(hidden_size=d_model, ffn_hidden_size=d_model),
            losses=LossConfig(load_balance="switch", aux_loss_coeff=1e-2),
        ),
    )
    return dataclasses.replace(cfg, moe=None) if kind == "dense" else cfg


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × active matmul parameters (the embedding lookup is not a
    matmul) + 6·L·S·d_attn for the attention scores and values (Kaplan et al. 2020)."""
    from moelab.models import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(cfg)
    c = count_params(model)
    matmul = c["active_per_token"] - cfg.vocab_size * cfg.d_model
    return 6.0 * matmul + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim


def rolling(xs: list[float], w: int) -> list[float]:
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x
        if i >= w:
            s -= xs[i - w]
        out.append(s / min(i + 1, w))
    return out


def read_metrics(run: Path) -> tuple[list[float], list[float], dict[int, float], float]:
    """Per-step training loss, seconds per step (log_every=1), the probe loss by step and the
    last validation bits per byte, from one read of metrics.jsonl."""
    loss, dt, probe, bpb = [], [], {}, math.nan
    for r in MetricsLog(run / "metrics.jsonl").read():
        if r["split"] == "train":
            loss.append(r["loss"])
            dt.append(r["tokens"] / r["step"] / r["tokens_per_s"] if r["step"] else 0.0)
        elif r["split"] == "probe":
            probe[r["step"]] = r["loss"]
        elif r["split"] == "val":
            bpb = r["bpb"]
    return loss, dt, probe, bpb


def probe_loss(model, streams: dict, tdict: dict) -> float:
    """Loss (nats/token) on the first PROBE_TOKENS of every validation domain: one fixed
    batch, so its curve has no minibatch noise."""
    r = evaluate(model, streams, seq_len=tdict["seq_len"], batch_size=tdict["batch_size"],
                 max_tokens=PROBE_TOKENS)  # fmt: skip
    return r.overall.loss


def probe_hook(streams: dict, tdict: dict, t_e: int):
    """``train(on_step=...)``: the probe loss of the model after each update in the spike
    windows (after t_e − 20 … t_e + 49 updates)."""

    def on_step(step: int, model) -> dict | None:
        if t_e - 20 <= step < t_e + 50:
            return {"loss": probe_loss(model, streams, tdict)}
        return None

    return on_step


def measure(run: Path, small, wide, tdict, t_e: int, cos: float, grown_probe: float | None) -> dict:
    """Spikes, final bpb and per-step FLOPs/seconds of one finished run. ``grown_probe``: the
    grown model's probe loss before its first update; None for the from-scratch run (whose
    model taking update t_e + 1 was probed in the loop)."""
    loss, step_s, probe, bpb = read_metrics(run)
    expanded = grown_probe is not None
    f_small, f_wide = (
        flops_per_token(small, tdict["seq_len"]),
        flops_per_token(wide, tdict["seq_len"]),
    )
    tokens = tdict["batch_size"] * tdict["seq_len"]
    flops = [tokens * (f_small if expanded and i < t_e else f_wide) for i in range(len(loss))]
    spike = 100 * (max(loss[t_e : t_e + 50]) / statistics.fmean(loss[t_e - 20 : t_e]) - 1)
    # the same windows on the probe: the model states that computed those training losses
    before = [probe[s] for s in range(t_e - 20, t_e)]
    after = [probe[t_e] if grown_probe is None else grown_probe]
    after += [probe[s] for s in range(t_e + 1, t_e + 50)]
    probe_spike = 100 * (max(after) / statistics.fmean(before) - 1)
    return {"loss": loss, "step_s": step_s, "flops": flops, "spike": spike, "cos": cos,
            "probe_spike": probe_spike, "bpb": bpb}  # fmt: skip


def run_setting(
    root: Path,
    key: str,
    small,
    wide,
    tdict,
    t_e: int,
    axis: str,
    methods: dict,
    rewarm_steps: int | None = None,
) -> dict:
    """The small run up to the expansion (shared), its expansions resumed to the end
    (``moelab expand`` + ``moelab train --resume``), and the from-scratch run."""
    factors = dict(zip(("hidden", "inner"), FACTORS[axis], strict=True))
    role = "hidden" if axis == "both" else axis  # the pair cosine of both: residual channels
    base = root / f"{key}-small"
    cfg = TrainConfig.from_dict(tdict)
    _, _, streams = prepare_data(cfg, None)
    hook = probe_hook(streams, tdict, t_e)
    train(small, cfg, base, progress=False, stop_after=t_e, on_step=hook)
    out = {}
    for method, how in methods.items():
        t0 = time.time()
        run = root / f"{key}-{method}"
        if how is None:
            train(wide, cfg, run, progress=False, stop_after=t_e + 200, on_step=hook)
            grown_probe = None
        else:
            extra = {"rewarm_steps": how.get("rewarm_steps", rewarm_steps)}
            extra.update({k: how[k] for k in ("rewarm_ratio", "rewarm_tail") if k in how})
            expand_run(
                base, run, init=how["expand_init"], state=how["expand_state"], **factors, **extra
            )
            grown_probe = probe_loss(load_model(latest_checkpoint_dir(run)), streams, tdict)
            train(None, None, run, resume=True, progress=False, stop_after=t_e + 200, on_step=hook)
        # symmetry 200 steps after the expansion, from that step's checkpoint (exact resume)
        cos = counterpart_cosine(load_model(latest_checkpoint_dir(run)), small, role)
        if t_e + 200 < tdict["steps"]:
            train(None, None, run, resume=True, progress=False, on_step=hook)
        out[method] = measure(run, small, wide, tdict, t_e, cos, grown_probe)
        r = out[method]
        print(
            f"{key}-{method}: spike {r['spike']:+.1f}%  probe {r['probe_spike']:+.2f}%  "
            f"cos {r['cos']:.3f}  bpb {r['bpb']:.4f}  {time.time() - t0:.0f} s",
            flush=True,
        )
    return out


def to_target(r: dict, target: float) -> tuple[float, float] | None:
    """(FLOPs, seconds) until the 20-step rolling loss first reaches ``target``."""
    for i, v in enumerate(rolling(r["loss"], 20)):
        if i >= 19 and v <= target:
            return sum(r["flops"][: i + 1]), sum(r["step_s"][: i + 1])
    return None


def fmt(xs: list[float], spec: str = ".2f") -> str:
    if not xs:
        return "—"
    if len(xs) == 1:
        return format(xs[0], spec)
    return f"{format(statistics.fmean(xs), spec)} ± {format(statistics.stdev(xs), spec)}"


def run_seed_setting(root: Path, seed: int, setting: tuple, args: argparse.Namespace) -> dict:
    """One pool job: every run of one setting at one seed (they share the small run)."""
    kind, axis, opt = setting
    small = small_config(kind, args.seq_len, args.d_model, args.layers, args.experts)
    wide = expanded_config(small, *FACTORS[axis])
    tdict = TrainConfig(
        data="mix", max_bytes_per_domain=args.max_bytes, seq_len=args.seq_len,
        batch_size=args.batch_size, steps=args.steps, lr=args.lr, warmup_steps=args.warmup,
        eval_every=10**6, eval_tokens=args.eval_tokens, checkpoint_every=50, log_every=1,
        seed=seed, split_seed=SPLIT_SEED, optimizer=opt,
    ).to_dict()  # fmt: skip
    key = f"{kind}-{axis}-{opt}-s{seed}"
    return run_setting(
        root, key, small, wide, tdict, args.expand_at, axis, args.run_methods, args.rewarm_steps
    )


RUN_NAME = re.compile(r"(dense|moe)-(hidden|inner|both)-(adamw|muon)-s(\d+)-(.+)")
"""A run folder's name: ``<kind>-<axis>-<optimizer>-s<seed>-<run>`` (:func:`run_seed_setting`)."""


def finished_runs(root: Path) -> dict[tuple[tuple[str, str, str], str], dict[int, Path]]:
    """``{(setting, run): {seed: folder}}`` of the folders in ``root`` holding a final model
    (the small pre-expansion runs stop early and have none).

    Raises:
        SystemExit: no finished run, or a run missing a seed the others have.
    """
    found: dict[tuple[tuple[str, str, str], str], dict[int, Path]] = {}
    for folder in sorted(root.iterdir()):
        m = RUN_NAME.fullmatch(folder.name)
        if m and (folder / "model.safetensors").is_file():
            kind, axis, opt, seed, method = m.groups()
            found.setdefault(((kind, axis, opt), method), {})[int(seed)] = folder
    if not found:
        raise SystemExit(f"{root}: no finished sparkling.py run in it")
    seeds = {tuple(sorted(s)) for s in found.values()}
    if len(seeds) != 1:
        raise SystemExit(f"{root}: the runs do not all have the same seeds ({sorted(seeds)})")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--expand-at", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=64, help="width before a hidden expansion")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer (top-2)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus cap per domain")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens/domain")
    ap.add_argument("--settings", default="all", help="comma list of indices into SETTINGS")
    ap.add_argument(
        "--ablation",
        action="store_true",
        help="sparkling+sym, sparkling+scaled, sparkling-noboost (with sparkling, copy, scratch)",
    )
    ap.add_argument(
        "--methods",
        default="all",
        help=f"comma list of runs out of {','.join(METHODS)} (copy and scratch are always run)",
    )
    ap.add_argument(
        "--rewarm-steps",
        type=int,
        default=None,
        help="τ_w of the re-warmed runs (default 0.8 %% of the steps after the expansion)",
    )
    ap.add_argument("--workers", type=int, default=2, help="parallel processes (setting, seed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", type=Path, default=None, help="write the shared result JSON here")
    args = ap.parse_args()
    if args.expand_at < 50 or args.steps < args.expand_at + 200 or args.expand_at % 50:
        ap.error("--expand-at: a multiple of 50 (checkpoints), >= 50, and <= steps - 200")
    if args.d_model % 16:
        ap.error("--d-model: a multiple of 16 (heads of 16)")
    methods = METHODS
    if args.methods != "all":
        names = set(args.methods.split(",")) | {"copy", "scratch"}
        unknown = names - set(METHODS)
        if unknown:
            ap.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
        methods = {k: v for k, v in METHODS.items() if k in names}
    if args.ablation:  # copy (the 1st-step reference) and scratch (the target) stay
        methods = {"sparkling": METHODS["sparkling"], "copy": METHODS["copy"], **ABLATIONS,
                   "scratch": None}  # fmt: skip
    args.run_methods = methods
    t_start = time.time()
    root = Path(tempfile.mkdtemp(prefix="sparkling-bench-"))
    chosen = (
        SETTINGS if args.settings == "all" else [SETTINGS[int(i)] for i in args.settings.split(",")]
    )
    # longest jobs first: MoE and Muon steps cost more than dense AdamW ones
    order = sorted(chosen, key=lambda s: (s[0] != "moe", s[2] != "muon"))
    grid = [(seed, setting) for setting in order for seed in range(args.seeds)]
    jobs = [(run_seed_setting, (root, seed, setting, args)) for seed, setting in grid]
    parts = run_jobs(jobs, args.workers, args.threads)
    results: dict[tuple, dict[str, list[dict]]] = {s: {} for s in chosen}  # seeds in order
    for (_, setting), by_method in zip(grid, parts, strict=True):
        for method, r in by_method.items():
            results[setting].setdefault(method, []).append(r)
    s_heads = max(1, args.d_model // 16)
    print(
        f"\nSPARKLING width expansion, mix corpus, {args.layers} layers D={args.d_model}→"
        f"{2 * args.d_model} (hidden; {s_heads} heads of 16 kept) or F→2F (expert; MoE "
        f"{args.experts} experts top-2 of F={args.d_model}, dense FFN {2 * args.d_model}), "
        f"expand at step {args.expand_at} of {args.steps}, batch {args.batch_size}×"
        f"{args.seq_len} bytes, lr {args.lr:g}, {args.seeds} seeds (mean ± sd)"
    )
    cols = (
        "spike %",
        "probe spike %",
        "1st-step Δ vs copy %",
        "pair cos @+200",
        "val bpb",
        "Δ bpb vs scratch",
        "FLOPs to target",
        "wall to target",
        "reached",
    )
    head = f"| setting | run | {' | '.join(cols)} |"
    print(head)
    print("|" + "---|" * (len(cols) + 2))
    t_e = args.expand_at
    cells = {setting: setting_cells(by_method, t_e) for setting, by_method in results.items()}
    for setting, by_method in cells.items():
        for method, runs in by_method.items():
            keys = dict.fromkeys(k for cell in runs for k in cell)
            col = {k: [cell[k] for cell in runs if k in cell] for k in keys}
            print(
                f"| {setting_label(setting)} | {method} | {fmt(col['spike_pct'], '+.1f')} | "
                f"{fmt(col['probe_spike_pct'], '+.2f')} | "
                f"{fmt(col.get('first_step_vs_copy_pct', []), '+.2f')} | "
                f"{fmt(col['pair_cos'], '.3f')} | {fmt(col['val_bpb'], '.4f')} | "
                f"{fmt(col.get('delta_bpb_vs_scratch', []), '+.4f')} | "
                f"{fmt(col.get('flops_to_target', []))} | "
                f"{fmt(col.get('wall_to_target', []))} | {sum(col['reached']):.0f}/{len(runs)} |"
            )
    print("\nPaired Δ val bpb (same seeds, same held-out documents; benchmarks/_paired.py)")
    for setting, by_method in results.items():
        print(f"{setting_label(setting)}:")
        print(
            "\n".join(paired_lines({m: [r["bpb"] for r in runs] for m, runs in by_method.items()}))
        )
    if args.json is not None:
        config = {k: v for k, v in vars(args).items() if k not in ("run_methods", "json")}
        write_result(result_json(cells, {**config, "methods": list(methods)}), args.json)
        print(f"result: {args.json}")
    print(f"\ntotal time {time.time() - t_start:.0f} s; runs in {root}")


def setting_cells(by_method: dict[str, list[dict]], t_e: int) -> dict[str, list[dict]]:
    """Per run and seed, the table's cells of one setting: spikes (%), 1st-step Δ vs copy (%,
    not for scratch), pair cos, val bpb, Δ bpb vs the same seed's scratch (not for scratch),
    ``reached`` (0/1) and, where reached, the FLOPs and wall-time ratios to scratch's target."""
    scratch = by_method["scratch"]
    targets = [rolling(r["loss"], 20)[-1] for r in scratch]
    base = [to_target(r, t) for r, t in zip(scratch, targets, strict=True)]
    out = {}
    for method, runs in by_method.items():
        out[method] = []
        for r, t, b, c, s in zip(runs, targets, base, by_method["copy"], scratch, strict=True):
            cell = {"spike_pct": r["spike"], "probe_spike_pct": r["probe_spike"],
                    "pair_cos": r["cos"], "val_bpb": r["bpb"]}  # fmt: skip
            if method != "scratch":
                cell["first_step_vs_copy_pct"] = 100 * (r["loss"][t_e] / c["loss"][t_e] - 1)
                cell["delta_bpb_vs_scratch"] = r["bpb"] - s["bpb"]
            reach = to_target(r, t)
            cell["reached"] = float(reach is not None and b is not None)
            if cell["reached"]:
                cell["flops_to_target"] = reach[0] / b[0]
                cell["wall_to_target"] = reach[1] / b[1]
            out[method].append(cell)
    return out


def result_json(cells: dict[tuple, dict[str, list[dict]]], config: dict):
    """The shared result (:mod:`moelab.utils.results`) of :func:`setting_cells`: one arm per
    (setting, run), named ``"moe hidden 2× adamw/sparkling"``, seeds 0..n-1; the
    compute-to-target ratios only in an arm whose every seed reached the target (every seed
    of an arm has the same metrics). Pairs: every run against the setting's scratch, and
    sparkling against each of the paper's ablations present."""
    metrics: dict[str, dict[int, dict[str, float]]] = {}
    pairs: list[tuple[str, str]] = []
    for setting, by_method in cells.items():
        for method, runs in by_method.items():
            keep = set.intersection(*(set(c) for c in runs)) - {"delta_bpb_vs_scratch"}
            metrics[arm_name(setting, method)] = {
                seed: {k: v for k, v in c.items() if k in keep} for seed, c in enumerate(runs)
            }
        pairs += arm_pairs(setting, by_method)
    return make_result("sparkling", "sparkling", config, metrics, pairs=pairs)


def arm_name(setting: tuple[str, str, str], run: str) -> str:
    """A result arm: ``"moe hidden 2× adamw/sparkling"``."""
    return f"{setting_label(setting)}/{run}"


def arm_pairs(setting: tuple[str, str, str], runs) -> list[tuple[str, str]]:
    """The :func:`compared_runs` of one setting as result arm pairs."""
    return [(arm_name(setting, a), arm_name(setting, b)) for a, b in compared_runs(runs)]


def compared_runs(methods) -> list[tuple[str, str]]:
    """``(run, baseline)`` pairs of one setting's runs: every run against scratch, then
    sparkling against each of the paper's ablations present (random-random first)."""
    pairs = [(m, "scratch") for m in methods if m != "scratch"]
    if "sparkling" in methods:
        pairs += [("sparkling", o) for o in ("random", *ABLATIONS) if o in methods]
    return pairs


def paired_lines(values: dict[str, list[float]]) -> list[str]:
    """The :func:`compared_runs` differences of one setting (``{run: per-seed values}``),
    paired by seed, one line each."""
    return [
        f"  {run + ' − ' + base:<40} {paired_line(values[run], values[base])}"
        for run, base in compared_runs(values)
    ]


if __name__ == "__main__":
    main()
