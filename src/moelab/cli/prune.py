"""``moelab prune``: remove whole experts (RaGEP and its baselines) and write a new run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._calibration import CalibBatch, CalibData, CalibSeqLen, CalibTokens
from moelab.cli._ranges import SEED, Range
from moelab.errors import InvalidValueError

METHODS = ("ragep", "reap", "frequency", "soft-frequency", "naee")


def parse_keep(text: str) -> float | int:
    """``"0.5"`` → 0.5 (a fraction), ``"16"`` → 16 (an absolute total of experts).

    Raises:
        ValueError: not a number.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise InvalidValueError(
            f"keep: expected a fraction in (0, 1) or a total number of experts, got {text!r}"
        ) from None


@app.command()
def prune(
    run: Annotated[Path, typer.Argument(help="Run folder or model folder to prune.")],
    out: Annotated[Path, Opt(help="New folder for the pruned model (must not exist).")],
    method: Annotated[str, Opt(help=f"Criterion: {', '.join(METHODS)}.")] = "ragep",
    keep: Annotated[
        str, Opt(help="Experts kept: a fraction in (0, 1) of all routed experts, or a total.")
    ] = "0.5",
    per_layer: Annotated[
        str | None,
        Opt(
            help="Budget per layer: 'uniform', 'rank' (RaGEP's effective-rank budgets) or "
            "'shuffled-rank' (the control: those budgets' scores given to other layers, a "
            "permutation seeded by --seed). Default: rank for ragep, uniform otherwise."
        ),
    ] = None,
    calib_data: CalibData = None,
    calib_tokens: CalibTokens = 32_768,
    seq_len: CalibSeqLen = None,
    batch_size: CalibBatch = 8,
    seed: Annotated[
        int, Opt(help="Seed of the calibration windows (and the shuffled-rank order)."), SEED
    ] = 0,
    min_experts: Annotated[int, Opt(help="Floor per layer besides top_k."), Range(min=1)] = 1,
    pca_rank: Annotated[int, Opt(help="RaGEP: subspace rank r per expert."), Range(min=1)] = 8,
    beta: Annotated[
        float, Opt(help="RaGEP: weight of energy vs. subspace novelty."), Range(min=0, max=1)
    ] = 0.5,
    span: Annotated[
        str,
        Opt(
            help="RaGEP: the other experts' span by svd (the true span) or qr (the authors' "
            "reduced QR, for exact reproduction)."
        ),
    ] = "svd",
    alpha: Annotated[
        float, Opt(help="Rank budgets: exponent of the effective rank."), Range(min=0)
    ] = 1.0,
    rank_source: Annotated[
        str, Opt(help="Effective rank of each MoE layer's 'output' or 'input'.")
    ] = "output",
    as_json: Annotated[bool, Opt("--json", help="Print prune.json instead of the table.")] = False,
) -> None:
    """Prune whole experts with RaGEP, REAP, frequency, soft frequency or NAEE enumeration.

    Writes OUT with the pruned model (it evaluates, analyses and generates like any run), its
    tokenizer, the run's run.json (model section updated) and prune.json (per-layer budgets,
    kept experts, effective ranks and scores).

    Examples:
      moelab prune runs/main --method ragep --keep 0.5 --out runs/main-ragep50
      moelab prune runs/main --method reap --keep 16 --per-layer uniform --out runs/main-reap
      moelab prune runs/e16 --method naee --keep 0.75 --calib-data mix --out runs/e16-naee
    """
    result, table = guarded(
        _prune, run, out, method, keep, per_layer, calib_data, calib_tokens, seq_len,
        batch_size, seed, min_experts, pca_rank, beta, span, alpha, rank_source,
    )  # fmt: skip
    if as_json:
        console.print_json(json.dumps(result))
    else:
        console.print(table)
        console.print(f"wrote {out} (prune.json, model, tokenizer)")


def _prune(
    run: Path, out: Path, method: str, keep_text: str, per_layer: str | None,
    calib_data: str | None, calib_tokens: int, seq_len: int | None, batch_size: int, seed: int,
    min_experts: int, pca_rank: int, beta: float, span: str, alpha: float, rank_source: str,
):  # fmt: skip
    from moelab.cli._common import check_source_model, load_run, write_derived_run
    from moelab.compress import (
        calibration_documents,
        calibration_set,
        domain_streams,
        run_data,
    )
    from moelab.compress.progress import TokenProgress
    from moelab.compress.prune import build_criterion, check_budget, check_model, prune_experts
    from moelab.train.loop import RUN_FILE, read_run_info, run_train_config
    from moelab.utils.outdir import check_output_folder

    if method not in METHODS:
        raise InvalidValueError(f"method: must be one of {', '.join(METHODS)}, got {method!r}")
    keep = parse_keep(keep_text)
    per_layer = per_layer or ("rank" if method == "ragep" else "uniform")
    check_output_folder(
        out, inputs=[run], flag=None
    )  # an empty folder (a killed write's) is reusable
    if calib_data is not None and not calib_data.strip():
        raise InvalidValueError(
            "calib_data: empty; name a corpus or omit it for the run's held-out text"
        )
    if rank_source not in ("input", "output"):
        raise InvalidValueError(f"rank_source: must be 'input' or 'output', got {rank_source!r}")
    for name, v in (("calib_tokens", calib_tokens), ("batch_size", batch_size)):
        if v < 1:
            raise InvalidValueError(f"{name}: must be >= 1, got {v}")
    criterion = build_criterion(method, **({"pca_rank": pca_rank, "beta": beta, "span": span}
                                           if method == "ragep" else {}))  # fmt: skip
    model, tokenizer = load_run(run)
    check_source_model(model, run, "prune")
    check_model(model)
    check_budget(model, keep, per_layer, min_experts)
    has_run = run.is_dir() and (run / RUN_FILE).exists()
    train_cfg = run_train_config(run) if has_run else None
    S = seq_len or (train_cfg.seq_len if train_cfg is not None else 256)
    if S < 1:
        raise InvalidValueError(f"seq_len: must be >= 1, got {S}")
    S = min(S, model.cfg.max_seq_len)
    streams = domain_streams(calibration_documents(calib_data, run_data(run)), tokenizer)
    calib = calibration_set(
        streams, tokens=calib_tokens, seq_len=S, batch_size=batch_size, seed=seed
    )
    with TokenProgress("calibrating", calib.n_tokens) as bar:
        result = prune_experts(
            model, calib, criterion, keep, per_layer=per_layer, min_experts=min_experts,
            alpha=alpha, rank_source=rank_source, progress=bar, seed=seed,
        )  # fmt: skip
    report = result.to_dict()
    report.update(
        source=str(run),
        calibration={"data": calib_data or "held-out documents of the run's training data",
                     "tokens": calib.n_tokens, "seq_len": S, "seed": seed,
                     "domains": list(calib.domain_names)},
    )  # fmt: skip
    write_derived_run(
        out,
        result.model,
        tokenizer,
        read_run_info(run) if has_run else None,
        "prune.json",
        report,
        run,
    )
    return report, _table(run, report)


def _table(run: Path, report: dict) -> Table:
    kept = f"{report['budget']}/{report['total_experts']}"
    table = Table(
        title=f"{run}: {report['method']} pruning, {report['per_layer']} budgets, {kept} experts kept"
    )
    for col in ("layer", "kept", "eff. rank", "kept experts", "scores (kept first)"):
        table.add_column(col, justify="left" if col.startswith(("kept e", "scores")) else "right")
    for r in report["layers"]:
        scores = r["scores"]
        if scores is None:
            shown = "-"
        else:
            order = r["keep"] + [e for e in range(r["experts"]) if e not in r["keep"]]
            shown = " ".join(f"{scores[e]:.3g}" for e in order[:8])
            shown += " …" if len(order) > 8 else ""
        table.add_row(
            str(r["layer"]), f"{r['kept']}/{r['experts']}", f"{r['effective_rank']:.2f}",
            ",".join(map(str, r["keep"])), shown,
        )  # fmt: skip
    return table
