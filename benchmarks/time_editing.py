"""TIME (ICML 2026, METHODS.md #18) on GeoFacts: lifelong editing of SmolLM2-135M's country
capitals with CP-tensor experts (intrinsic routing) vs LoRA + key, GRACE and FT-L.

Setting (``shared/research/wave3-continual.md`` §4.2; :mod:`moelab.methods.editing`): frozen
SmolLM2-135M-Instruct (``load_pretrained("smollm2")``), the input of ``w_down`` in block 22 of
30, one LiveEdit chunk of ``--n-edits`` sequential counterfactual capital edits, scored after
the whole stream: reliability, generality (2 held-out paraphrases), neighbour locality (2
unedited countries per edit) and subject locality (the edited country's continent), LiveEdit's
teacher-forced token accuracy in %; parameters per edit, seconds per edit, the inference
latency overhead of the edited model on the evaluation pass (blocks 22-29), and a check that
restoring gives the original weights bit for bit.

The claim checked (the issue's reading of the abstract): mean over seeds of TIME's score (the
mean of the four metrics) >= LoRA+key's - 1 point, while an edit costs <= 0.3x LoRA+key's
parameters.

Usage::

    python benchmarks/time_editing.py                        # 50 edits, seeds 0 1 2
    python benchmarks/time_editing.py --n-edits 10 --seeds 0 # a quick look (a few minutes)

Seeds run one after another (the model loads once; the arms of a seed share its pre-edit pass);
after each seed the result so far is written (``extra.partial`` until every seed is done).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch

from moelab.methods.editing import EditConfig, TimeEditingRecipe
from moelab.methods.runner import run_seeds
from moelab.utils.atomic import atomic_write_text
from moelab.utils.result_tables import paired_table
from moelab.utils.results import make_result, write_result

ARMS = {
    "time": {"method": "time"},
    "lora-key": {"method": "lora-key"},
    "grace": {"method": "grace"},
    "ft-l": {"method": "ft-l"},
}
LABELS = {"time": "TIME (inferred)", "lora-key": "LoRA + key", "grace": "GRACE", "ft-l": "FT-L"}
COLUMNS = (
    ("reliability", ".1f"),
    ("generality", ".1f"),
    ("locality_neighbour", ".1f"),
    ("locality_subject", ".1f"),
    ("score", ".1f"),
    ("params_per_edit", ".0f"),
    ("edit_seconds", ".2f"),
    ("latency_overhead_pct", "+.1f"),
    ("fired_token_fraction", ".3f"),
)
MARGIN, PARAM_RATIO = 1.0, 0.3


def _cell(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(float(np.mean(values)), fmt)} ± {format(float(np.std(values, ddof=1)), fmt.lstrip('+'))}"


def report(result) -> tuple[str, dict]:
    """The markdown table and the claim verdict of a result."""
    seeds, m = list(result.seeds), result.metrics
    lines = [
        "| arm | " + " | ".join(c for c, _ in COLUMNS) + " |",
        "|" + "---|" * (1 + len(COLUMNS)),
    ]
    for arm in result.arms:
        cells = [_cell([m[arm][s][c] for s in seeds], f) for c, f in COLUMNS]
        lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(cells) + " |")
    score = {a: float(np.mean([m[a][s]["score"] for s in seeds])) for a in ("time", "lora-key")}
    params = {a: m[a][seeds[0]]["params_per_edit"] for a in ("time", "lora-key")}
    ratio = params["time"] / params["lora-key"]
    diff = score["time"] - score["lora-key"]
    verdict = {
        "score_time": score["time"],
        "score_lora_key": score["lora-key"],
        "score_diff": diff,
        "param_ratio": ratio,
        "score_holds": bool(diff >= -MARGIN),
        "params_hold": bool(ratio <= PARAM_RATIO),
        "holds": bool(diff >= -MARGIN and ratio <= PARAM_RATIO),
        "restore_exact_all": bool(
            all(m[a][s]["restore_exact"] == 1.0 for a in result.arms for s in seeds)
        ),
    }
    lines += [
        "",
        f"Claim: score(TIME) >= score(LoRA+key) - {MARGIN:g} at <= {PARAM_RATIO:g}x the "
        f"parameters per edit: {diff:+.1f} points at {ratio:.2f}x -> "
        f"{'holds' if verdict['holds'] else 'does not hold'}.",
    ]
    return "\n".join(lines) + "\n", verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n-edits", type=int, default=EditConfig.n_edits)
    p.add_argument("--model", default=EditConfig.model)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/bench/time.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = EditConfig(model=args.model, n_edits=args.n_edits)
    recipe = TimeEditingRecipe()
    start = time.perf_counter()
    metrics = {arm: {} for arm in ARMS}
    seconds = {arm: {} for arm in ARMS}
    settings = {"recipe": "time", "base": dataclasses.asdict(base), "arms": ARMS}
    for i, seed in enumerate(args.seeds):
        part = run_seeds(recipe, base, [seed], arms=ARMS)
        for arm in ARMS:
            metrics[arm][seed] = part.metrics[arm][seed]
            seconds[arm].update(part.extra["run_seconds"][arm])
        done = args.seeds[: i + 1]
        elapsed = time.perf_counter() - start
        result = make_result("time", "time", settings, metrics)
        table, verdict = report(result)
        result = dataclasses.replace(
            result,
            extra={
                "run_seconds": seconds,
                "wall_seconds": elapsed,
                "claim": verdict,
                "partial": done != args.seeds,
                "seeds_planned": args.seeds,
            },
        )
        write_result(result, args.out)
        print(f"seed {seed} done ({elapsed / 60:.1f} min)", flush=True)
    pairs = paired_table([result], ["score", "reliability", "generality", "locality_neighbour"])
    atomic_write_text(args.out.with_suffix(".md"), table + "\n" + pairs)
    print(table)
    print(pairs)
    print(f"wall time {elapsed / 60:.1f} min ({math.ceil(elapsed)} s); result: {args.out}")


if __name__ == "__main__":
    main()
