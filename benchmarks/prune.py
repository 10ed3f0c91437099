"""Expert pruning benchmark: RaGEP vs. its baselines at 75 / 50 / 25 % of the experts.

For each run (the ``make run`` model, 8 experts top-2, and its 16-expert twin), each kept
fraction, each criterion (RaGEP Spectral-Salience, REAP, frequency, soft frequency, NAEE
enumeration) and each budget rule (uniform, RaGEP's rank-aware, and the control
``shuffled-rank``: the rank budgets given to other layers, uneven but not rank-derived), over 3
calibration seeds; RaGEP once per (r, β) of ``--pca-ranks × --betas`` (the authors set both per
model), with each layer's Expert Subspace Novelty spread printed next to the value random
r-dimensional subspaces give, ``1 − (E−1)·r/D``:

- validation bits per byte per domain and overall, on the *evaluation half* of the run's
  held-out documents (:func:`moelab.compress.held_out_documents`); calibration windows come
  from the other half, drawn with the seed;
- a held-out 4-way next-sentence multiple choice: a context (the ``--mc-context`` characters
  before a line) and four candidate next lines — the true one and three from other documents of
  the same domain — scored by the model's domain-conditional PMI ``log p(c | context) −
  log p(c | "\n")``; accuracy over the items (chance 25 %). [Our choice: the mean
  log-likelihood per byte puts the unpruned ``make run`` model at chance (0.25 on 120 items),
  PMI at 0.39: a line's own likelihood swamps the context's evidence for a byte-level model.] A domain whose evaluation half is one document (a play, a book) is
  cut into 4 KB pieces that count as documents [our choice: the held-out split of this corpus
  has one document for those domains].

The items and the evaluation text are fixed; only the calibration windows change with the
seed. Pruned models whose kept-expert sets coincide are evaluated once. Prints one table:
mean ± sd over the seeds, and the paper's claim per (model, keep): RaGEP (rank budgets +
Spectral-Salience) has a loss increase no larger than every baseline's at the same budget.

Usage::

    python benchmarks/prune.py --runs /work/runs/main /work/runs/e16
    python benchmarks/prune.py --runs /work/runs/main --calib-tokens 2048 --eval-tokens 2048
    # the SmolLM2 testbed (benchmarks/smol_testbed.py; a folder without run.json reads --data)
    python benchmarks/prune.py --runs runs/smol/g8k2 --calib-tokens 32768 --seq-len 256 \
        --pca-ranks 2 4 8 --betas 0.5 0.8 1.0 --min-experts 2 --save prune-smol.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from _compress_text import add_text_options, text_documents
from _mc import mc_accuracy, mc_items
from _pool import run_jobs
from moelab.compress import calibration_set, domain_streams
from moelab.compress.prune import build_criterion, calibrate, layer_budgets, prune_experts
from moelab.data import load_tokenizer
from moelab.models import load_model
from moelab.models.hooks import moe_layers
from moelab.train.evaluate import evaluate
from moelab.utils.results import BenchmarkResult, make_result, write_result

METHODS = ("ragep", "reap", "frequency", "soft-frequency", "naee")
BUDGETS = ("uniform", "rank", "shuffled-rank")


def score(model, streams, items, seq_len, eval_tokens, prefix) -> dict[str, float]:
    ev = evaluate(model, streams, seq_len=seq_len, batch_size=8, max_tokens=eval_tokens)
    out = {f"bpb/{k}": v.bits_per_byte for k, v in ev.per_domain.items()}
    out["bpb"] = ev.overall.bits_per_byte
    if items:  # --mc-items 0 leaves the multiple choice out
        out.update({f"mc/{k}": v for k, v in mc_accuracy(model, items, prefix).items()})
    return out


def _acc(rows: list[dict]) -> str:
    """Mean ± sd of the rows' multiple-choice accuracy; "-" without multiple choice."""
    if "mc/all" not in rows[0]:
        return "-"
    return _mean_sd([r["mc/all"] for r in rows], digits=3)


def _mean_sd(xs: list[float], digits: int = 4) -> str:
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{m:.{digits}f}±{sd:.{digits}f}"


def bench_run(run: Path, args, seeds: list[int]) -> list[dict]:
    """Every setting of one run for the calibration ``seeds`` (rows of the table)."""
    model = load_model(run).eval()
    tok = load_tokenizer(run)
    calib_docs, eval_docs = text_documents(run, args)
    calib_streams = domain_streams(calib_docs, tok, prefix="calib/")
    eval_streams = domain_streams(eval_docs, tok, prefix="eval/")
    items = mc_items(eval_docs, tok, args.mc_items, args.mc_context)
    seq_len = min(args.seq_len, model.cfg.max_seq_len)
    E = moe_layers(model)[0].experts.num_experts
    D = model.cfg.d_model
    t0 = time.perf_counter()
    prefix = tok.encode("\n")
    base = score(model, eval_streams, items, seq_len, args.eval_tokens, prefix)
    print(f"[{run.name}] E={E} unpruned bpb {base['bpb']:.4f} mc {_acc([base])} "
          f"({len(items)} items, {time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    cache: dict[tuple, dict[str, float]] = {}
    rows = [{"run": run.name, "E": E, "keep": 1.0, "budget": "-", "method": "unpruned",
             "seed": s, **base} for s in seeds]  # fmt: skip
    for seed in seeds:
        calib = calibration_set(
            calib_streams, tokens=args.calib_tokens, seq_len=seq_len, batch_size=8, seed=seed
        )
        stats = calibrate(model, calib)
        esn_done = set()
        first_with: dict[tuple, str] = {}  # (keep, per-layer counts) -> first budget rule
        for keep in args.keeps:
            for budget in args.budgets:
                counts = layer_budgets(
                    model, stats, keep, budget, min_experts=args.min_experts, seed=seed
                )[1]
                same = first_with.setdefault((keep, tuple(counts)), budget)
                for method, opts in variants(args):
                    if args.only is not None and f"{budget}/{method}" not in args.only:
                        continue
                    prev = next((r for r in rows if (r["seed"], r.get("keep"), r.get("budget"),
                                 r["method"]) == (seed, keep, same, method)), None)  # fmt: skip
                    if same != budget and prev is not None:  # e.g. every layer at its floor:
                        rows.append({**prev, "budget": budget})  # one selection, reused
                        print(f"[{run.name}] seed {seed} keep {keep} {budget:13s} {method:16s} "
                              f"as {same} (the same per-layer counts)", flush=True)  # fmt: skip
                        continue
                    t = time.perf_counter()
                    res = prune_experts(
                        model, calib, build_criterion(method.split(" ")[0], **opts), keep,
                        per_layer=budget, stats=stats, min_experts=args.min_experts, seed=seed,
                    )  # fmt: skip
                    if "pca_rank" in opts and opts["pca_rank"] not in esn_done:
                        # ESN depends on r only (not on β, the budget or the keep: every layer's
                        # subspaces are those of all E experts); the first pass records it
                        esn_done.add(opts["pca_rank"])
                        rows.append({"run": run.name, "E": E, "D": D, "seed": seed,
                                     "method": "esn", "pca_rank": opts["pca_rank"],
                                     "esn": [x.details["esn"] for x in res.layers]})  # fmt: skip
                    key = tuple(tuple(r.keep) for r in res.layers)
                    hit = key in cache
                    if not hit:
                        cache[key] = score(
                            res.model, eval_streams, items, seq_len, args.eval_tokens, prefix
                        )
                    r = cache[key]
                    rows.append({"run": run.name, "E": E, "keep": keep, "budget": budget,
                                 "method": method, "seed": seed, "counts":
                                 [x.kept for x in res.layers], **r})  # fmt: skip
                    print(f"[{run.name}] seed {seed} keep {keep} {budget:13s} {method:16s} "
                          f"counts {[x.kept for x in res.layers]} bpb {r['bpb']:.4f} "
                          f"mc {_acc([r])} {'(cached) ' if hit else ''}"
                          f"{time.perf_counter() - t:.0f}s", flush=True)  # fmt: skip
    return rows


def shared_result(rows: list[dict], args) -> BenchmarkResult:
    """The rows as the shared result: one arm per (run, keep, budget, criterion) and the
    unpruned model per run, calibration seeds as seeds; pairs: RaGEP with rank budgets
    against every other setting of the same run and keep, and every setting against the
    unpruned model."""
    metrics: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        if r["method"] == "esn":
            continue
        arm = (f"{r['run']}/unpruned" if r["method"] == "unpruned"
               else f"{r['run']}/keep{r['keep']:g}/{r['budget']}/{r['method']}")  # fmt: skip
        metrics.setdefault(arm, {})[r["seed"]] = {
            k: float(v) for k, v in r.items() if k == "bpb" or k.startswith(("bpb/", "mc/"))
        }
    pairs = []
    for arm in metrics:
        run, *rest = arm.split("/")
        if rest == ["unpruned"]:
            continue
        pairs.append((arm, f"{run}/unpruned"))
        keep, budget, method = rest
        if budget == "rank" and method.startswith("ragep"):
            pairs += [(arm, other) for other in metrics
                      if other.startswith(f"{run}/{keep}/") and other != arm
                      and not other.split("/")[3].startswith("ragep")]  # fmt: skip
    config = {k: v for k, v in vars(args).items() if k not in ("merge", "save", "result")}
    return make_result("prune", "ragep", json.loads(json.dumps(config, default=str)), metrics,
                       pairs=pairs)  # fmt: skip


def variants(args) -> list[tuple[str, dict]]:
    """``(label, criterion options)`` of every criterion setting: RaGEP once per (r, β) of the
    sweep (labelled ``"ragep r{r} b{β}"`` when there is more than one), the others once."""
    out = []
    for method in args.methods:
        if method != "ragep":
            out.append((method, {}))
            continue
        grid = [(r, b) for r in args.pca_ranks for b in args.betas]
        for r, b in grid:
            label = "ragep" if len(grid) == 1 else f"ragep r{r} b{b:g}"
            out.append((label, {"pca_rank": r, "beta": b, "span": args.span}))
    return out


def print_esn(rows: list[dict]) -> None:
    """Each layer's ESN spread (min–max over the experts, seed-averaged) next to the value of
    random r-dimensional subspaces, ``1 − (E−1)·r/D`` (the expected novelty when the other
    experts' bases are random: they cover a fraction ``(E−1)·r/D`` of the space)."""
    esn = [r for r in rows if r["method"] == "esn"]
    for run in dict.fromkeys(r["run"] for r in esn):
        for rank in sorted({r["pca_rank"] for r in esn if r["run"] == run}):
            g = [r for r in esn if r["run"] == run and r["pca_rank"] == rank]
            E, D = g[0]["E"], g[0]["D"]
            rand = max(0.0, 1 - (E - 1) * rank / D)
            lo = [statistics.fmean(min(r["esn"][i]) for r in g) for i in range(len(g[0]["esn"]))]
            hi = [statistics.fmean(max(r["esn"][i]) for r in g) for i in range(len(g[0]["esn"]))]
            print(f"\n{run} ESN r={rank} (random subspaces: {rand:.3f}), per layer min–max:")
            print("  " + " ".join(f"{a:.2f}–{b:.2f}" for a, b in zip(lo, hi, strict=True)))


def print_table(rows: list[dict], args) -> None:
    print_esn(rows)
    rows = [r for r in rows if r["method"] != "esn"]
    domains = sorted({k[4:] for r in rows for k in r if k.startswith("bpb/")})
    cols = ["run", "keep", "budget", "method", "counts", "bpb", "Δbpb"]
    cols += [f"bpb {d}" for d in domains] + ["MC acc"]
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    claims = []
    for run in dict.fromkeys(r["run"] for r in rows):
        ref = [r for r in rows if r["run"] == run and r["method"] == "unpruned"]
        ref_bpb = statistics.fmean(r["bpb"] for r in ref)
        print(f"| {run} | 1.0 | - | unpruned | - | {ref_bpb:.4f} | 0 | "
              + " | ".join(f"{ref[0][f'bpb/{d}']:.4f}" for d in domains)
              + f" | {_acc(ref[:1])} |")  # fmt: skip
        for keep in args.keeps:
            deltas = {}
            for budget in args.budgets:
                for method, _ in variants(args):
                    g = [r for r in rows if r["run"] == run and r["keep"] == keep
                         and r["budget"] == budget and r["method"] == method]  # fmt: skip
                    if not g:
                        continue
                    d = [r["bpb"] - ref_bpb for r in g]
                    deltas[(budget, method)] = statistics.fmean(d)
                    counts = {tuple(r["counts"]) for r in g}
                    shown = "/".join(map(str, g[0]["counts"])) if len(counts) == 1 else "varies"
                    cells = [run, str(keep), budget, method, shown,
                             _mean_sd([r["bpb"] for r in g]), _mean_sd(d)]  # fmt: skip
                    cells += [_mean_sd([r[f"bpb/{dm}"] for r in g]) for dm in domains]
                    cells.append(_acc(g))
                    print("| " + " | ".join(cells) + " |")
            for (budget, mine_m), mine in deltas.items():
                if budget != "rank" or not mine_m.startswith("ragep"):
                    continue
                worse = [f"{b}/{m} ({v:+.4f})" for (b, m), v in deltas.items()
                         if not m.startswith("ragep") and v < mine - 1e-12]  # fmt: skip
                claims.append(
                    f"{run} keep {keep}: {mine_m} (rank budgets) Δbpb {mine:+.4f} — "
                    + ("holds (no baseline lower)" if not worse else "does NOT hold; lower: "
                       + ", ".join(worse))
                )  # fmt: skip
    print("\nClaim (RaGEP's loss increase <= every baseline's at the same budget):")
    for c in claims:
        print("  " + c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs", nargs="+", type=Path, default=[Path("/work/runs/main"), Path("/work/runs/e16")]
    )
    p.add_argument("--keeps", nargs="+", type=float, default=[0.75, 0.5, 0.25])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=BUDGETS)
    p.add_argument(
        "--only",
        nargs="+",
        help="run only these budget/criterion settings (e.g. rank/ragep uniform/reap) of the "
        "--budgets × --methods grid",
    )
    p.add_argument(
        "--result", type=Path, help="write the shared result JSON (moelab.result/1) here"
    )
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--eval-tokens", type=int, default=1536, help="per domain")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--mc-items", type=int, default=8, help="per domain (0: no multiple choice)")
    p.add_argument("--mc-context", type=int, default=64, help="context characters")
    p.add_argument("--save", type=Path, help="also write the per-seed rows as JSON here")
    p.add_argument("--jobs", type=int, default=1, help="(run, seed) tasks in parallel processes")
    p.add_argument("--merge", nargs="+", type=Path, help="print the table of saved --save files")
    p.add_argument("--pca-ranks", nargs="+", type=int, default=[8], help="RaGEP's r (a sweep)")
    p.add_argument("--betas", nargs="+", type=float, default=[0.5], help="RaGEP's β (a sweep)")
    p.add_argument("--span", default="svd", choices=["svd", "qr"], help="RaGEP's Q_{-e} rule")
    add_text_options(p)
    p.add_argument("--min-experts", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is far faster on a busy box)"
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    if args.merge:
        for f in args.merge:
            rows += json.loads(f.read_text())
    else:
        tasks = [(bench_run, (run, args, [seed])) for run in args.runs for seed in args.seeds]
        for part in run_jobs(tasks, args.jobs, args.threads):
            rows += part
    if args.save is not None:
        args.save.write_text(json.dumps(rows, indent=1))
    if args.result is not None:
        write_result(shared_result(rows, args), args.result)
    print_table(rows, args)
    if args.merge:
        print(f"\nmerged {len(args.merge)} saved file(s), {len(rows)} rows")
        return
    print(f"\n{len(args.runs)} runs, {len(args.seeds)} seeds, calibration {args.calib_tokens} "
          f"tokens, eval {args.eval_tokens} tokens/domain, MC {args.mc_items} items/domain; "
          f"total {time.perf_counter() - t0:.0f}s")  # fmt: skip
    if math.isnan(rows[0]["bpb"]):
        raise SystemExit("nan loss")


if __name__ == "__main__":
    main()
