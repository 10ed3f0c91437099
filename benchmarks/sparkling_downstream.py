"""SPARKLING's downstream score: the held-out next-line multiple choice (``_mc.py``) on every
finished run of a ``sparkling.py`` runs folder.

``sparkling.py`` keeps its runs (it prints ``runs in ROOT``); each finished run folder,
``<kind>-<axis>-<optimizer>-s<seed>-<run>``, holds the final model. Every run is scored on
the same items: ``--mc-items`` next-line questions per domain drawn from the validation
documents of the runs' split (``split_seed`` 0, never trained on by any run), with contexts
of ``--mc-context`` characters so that a question fits the models' 128-byte window (longer
ones are dropped and counted). Accuracy overall and per domain, chance 25 %; the paper's
claim is that the expanded model does better than scratch downstream.

Prints mean ± sd per run and the paired differences against scratch (and sparkling against
the paper's ablations) per setting, and writes the shared result JSON with ``--json``.

Usage::

    python benchmarks/sparkling.py --settings 0,1,2,3,4 --json sparkling.json   # prints ROOT
    python benchmarks/sparkling_downstream.py ROOT --json sparkling_downstream.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _mc import mc_accuracy, mc_items
from _pool import run_jobs
from moelab.compress import held_out_documents, run_data
from moelab.data import load_tokenizer
from moelab.models import load_model
from moelab.utils.results import make_result, write_result
from sparkling import arm_name, arm_pairs, finished_runs, fmt, paired_lines, setting_label


def score(folder: Path, items, prefix: list[int]) -> dict[str, float]:
    """One pool job: the multiple-choice accuracy of ``folder``'s final model."""
    acc = mc_accuracy(load_model(folder).eval(), items, prefix)
    return {("mc_acc" if k == "all" else f"mc_acc/{k}"): v for k, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the runs folder sparkling.py printed")
    ap.add_argument("--mc-items", type=int, default=60, help="questions per domain")
    ap.add_argument("--mc-context", type=int, default=40, help="context characters")
    ap.add_argument("--workers", type=int, default=2, help="parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", type=Path, default=None, help="write the shared result JSON here")
    args = ap.parse_args()
    t0 = time.time()
    runs = finished_runs(args.root)
    first = next(iter(next(iter(runs.values())).values()))
    calib, evaluation = held_out_documents(run_data(first))
    tok = load_tokenizer(first)
    window = load_model(first).cfg.max_seq_len
    drawn = mc_items([*calib, *evaluation], tok, args.mc_items, args.mc_context)
    items = [it for it in drawn if len(it.context) + max(map(len, it.candidates)) <= window]
    prefix = tok.encode("\n")
    keys = [(key, seed) for key, by_seed in runs.items() for seed in sorted(by_seed)]
    jobs = [(score, (runs[key][seed], items, prefix)) for key, seed in keys]
    scores = run_jobs(jobs, args.workers, args.threads)
    scored: dict[tuple, dict[int, dict[str, float]]] = {}  # (setting, run) -> seed -> scores
    for (key, seed), acc in zip(keys, scores, strict=True):
        scored.setdefault(key, {})[seed] = acc
    metrics = {arm_name(*key): by_seed for key, by_seed in scored.items()}
    settings = dict.fromkeys(setting for setting, _ in runs)
    print(
        f"\nSPARKLING downstream: next-line multiple choice, {len(items)} items "
        f"({len(drawn) - len(items)} longer than the {window}-byte window dropped), "
        f"{args.mc_context}-character contexts, chance 0.25; accuracy mean ± sd over seeds"
    )
    pairs: list[tuple[str, str]] = []
    for setting in settings:
        acc = {
            method: [by_seed[s]["mc_acc"] for s in sorted(by_seed)]
            for (s2, method), by_seed in scored.items()
            if s2 == setting
        }
        print(f"{setting_label(setting)}:")
        for method, vals in acc.items():
            print(f"  {method:<40} {fmt(vals, '.3f')}")
        print("\n".join(paired_lines(acc)))
        pairs += arm_pairs(setting, acc)
    if args.json is not None:
        config = {"root": str(args.root), "items": len(items), "mc_items": args.mc_items,
                  "mc_context": args.mc_context,
                  "settings": [setting_label(s) for s in settings]}  # fmt: skip
        write_result(
            make_result("sparkling_downstream", "sparkling", config, metrics, pairs=pairs),
            args.json,
        )
        print(f"result: {args.json}")
    print(f"total time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
