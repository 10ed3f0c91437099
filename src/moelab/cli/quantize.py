"""``moelab quantize``: post-training quantization of the routed experts (RTN, GPTQ or GPTVQ, with
optional low-rank compensation: per-expert, 1-D shared, TileQ's 2-D grid as the authors' code
does it (``tileq``) or moelab's TileQ variant with r × r cores (``tileq-core``)).

The written folder evaluates, analyses and generates like any run:

    config.json, model.safetensors, manifest.json   (quantized banks; moelab.models.save_model)
    tokenizer_meta.json, tokenizer.json              (the source's tokenizer)
    run.json                                         (the source run's, when it has one)
    quantize.json                                    spec, calibration, bits per parameter,
                                                     per-layer errors, under-calibrated experts,
                                                     quantized dense projections (--dense-bits)

It is assembled in a temporary sibling folder and renamed into place: on any error nothing is
written.
"""

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

QUANTIZE_FILE = "quantize.json"


def parse_grid(text: str | None) -> tuple[int, int] | None:
    """``"4x4"`` → ``(4, 4)``; None stays None.

    Raises:
        ValueError: not two positive integers joined by ``x``.
    """
    if text is None:
        return None
    parts = text.lower().split("x")
    try:
        M, N = (int(p) for p in parts)
    except ValueError:
        raise InvalidValueError(f"grid: expected MxN such as 4x4, got {text!r}") from None
    if M < 1 or N < 1:
        raise InvalidValueError(f"grid: both sides must be >= 1, got {text!r}")
    return M, N


def square_grid(num_experts: int) -> tuple[int, int]:
    """The most square ``M x N = E`` with ``M <= N`` (TileQ's √K × √K when E is a square)."""
    m = int(num_experts**0.5)
    while num_experts % m:
        m -= 1
    return m, num_experts // m


@app.command()
def quantize(
    run: Annotated[Path, typer.Argument(help="Run folder or model folder to quantize.")],
    out: Annotated[Path, Opt(help="New folder for the quantized model (must not exist).")],
    method: Annotated[
        str, Opt(help="rtn, gptq or gptvq (vector quantization with codebooks).")
    ] = "gptq",
    bits: Annotated[
        int, Opt(help="Bits per weight: 2, 3, 4 or 8 (gptvq: per dimension, 2 to 4)."), Range(min=1)
    ] = 4,
    group_size: Annotated[
        int, Opt(help="Input columns per scale (gptvq: per codebook)."), Range(min=1)
    ] = 64,
    vq_dim: Annotated[
        int, Opt(help="gptvq: vector length d (1, 2 or 4; 2^(bits·d) centroids).")
    ] = 2,
    vq_rows: Annotated[
        int,
        Opt(
            help="gptvq: output rows per codebook; 0: the common divisor of the widths nearest "
            "the authors' codebook size (8-bit centroids costing 0.125 bits per weight)."
        ),
        Range(min=0),
    ] = 0,
    symmetric: Annotated[bool, Opt(help="Symmetric grid (no zero points).")] = False,
    act_order: Annotated[
        bool, Opt(help="GPTQ: quantize columns by decreasing Hessian diagonal.")
    ] = True,
    damp: Annotated[
        float, Opt(help="GPTQ dampening (fraction of mean diag H)."), Range(min=0)
    ] = 0.01,
    group_stats: Annotated[
        str,
        Opt(
            help="GPTQ: where a group's scale is read: reference (the reference code: the "
            "weights as earlier blocks left them) or updated (with the current block's "
            "updates)."
        ),
    ] = "reference",
    rotate_block: Annotated[
        int,
        Opt(
            help="GPTQ on the permuted, partially block-Hadamard-rotated residual (the TileQ/"
            "LoPRo authors' rotation; Walsh block size, a power of two dividing the widths; "
            "turns act-order off). 0: off."
        ),
        Range(min=0),
    ] = 0,
    lowrank: Annotated[
        str,
        Opt(
            help="none, per-expert, shared-1d, tileq (the authors' code: fit W with per-expert "
            "AWQ scales once, quantize the residual, one shared Σ, k-means grid) or tileq-core "
            "(moelab's variant: r x r cores, HOOI, balanced grid)."
        ),
    ] = "none",
    rank: Annotated[int, Opt(help="Rank of the low-rank compensation."), Range(min=1)] = 8,
    grid: Annotated[
        str | None,
        Opt(
            help="TileQ grid MxN. tileq: M rows sharing the input-side factor, N columns, "
            "M·N >= experts (default: M = power of two >= sqrt(E)); tileq-core: M·N = experts "
            "(default: most square)."
        ),
    ] = None,
    sweeps: Annotated[int, Opt(help="tileq-core HOOI refinement sweeps."), Range(min=0)] = 2,
    lowrank_target: Annotated[
        str,
        Opt(
            help="Fit the factors to the quantization 'error' W − Q(W); to the 'weight' first, "
            "quantize the residual and refit; or 'weight-once' (fit W, quantize the residual, "
            "keep the fit); 'auto': weight-once for tileq, error otherwise."
        ),
    ] = "auto",
    weighting: Annotated[
        str,
        Opt(
            help="Low-rank activation weighting: 'full' (H+λI)^1/2, 'diag' sqrt(diag H), 'awq' "
            "(per-expert mean|x| scales; per-expert/tileq); 'auto': awq for tileq, else full."
        ),
    ] = "auto",
    min_tokens: Annotated[
        int,
        Opt(help="Experts routed fewer calibration rows get RTN (under-calibrated)."),
        Range(min=0),
    ] = 16,
    sequential: Annotated[
        bool, Opt(help="Calibrate each layer on the already quantized layers before it.")
    ] = True,
    dense_bits: Annotated[
        int,
        Opt(
            help="Also quantize every dense projection (attention, dense FFN, LM head; not the "
            "routers) to this many bits (8 or 4 take the decode kernel; 2 and 3 dequantize), "
            "RTN symmetric with --group-size columns per scale, as llama.cpp's Q8_0 does. "
            "0: keep them float."
        ),
        Range(min=0),
    ] = 0,
    calib_data: CalibData = None,
    calib_tokens: CalibTokens = 32_768,
    seq_len: CalibSeqLen = None,
    batch_size: CalibBatch = 8,
    seed: Annotated[int, Opt(help="Seed of the calibration windows and grid search."), SEED] = 0,
    as_json: Annotated[
        bool, Opt("--json", help="Print quantize.json instead of the table.")
    ] = False,
) -> None:
    """Quantize every MoE layer's experts; report bits per parameter including scales, zero
    points and low-rank factors.

    Examples:
      moelab quantize runs/main --method gptq --bits 3 --out runs/main-q3
      moelab quantize runs/e16 --bits 2 --lowrank tileq --rank 8 --grid 4x4 --out runs/e16-tq2
      moelab quantize runs/e16 --bits 2 --lowrank tileq --rank 4 --rotate-block 64 --out runs/e16-tr2
      moelab quantize runs/e16 --bits 2 --lowrank tileq-core --rank 8 --out runs/e16-tc2
      moelab quantize runs/main --method rtn --bits 4 --lowrank per-expert --out runs/main-r4
      moelab quantize runs/main --method gptvq --bits 2 --vq-dim 2 --out runs/main-vq2
      moelab quantize runs/main --method rtn --bits 8 --symmetric --dense-bits 8 --out runs/main-q8
    """
    report, table = guarded(
        _quantize, run, out, method, bits, group_size, vq_dim, vq_rows, symmetric, act_order, damp, group_stats, rotate_block, lowrank,
        rank, grid, sweeps, lowrank_target, weighting, min_tokens, sequential, dense_bits, calib_data,
        calib_tokens, seq_len, batch_size, seed,
    )  # fmt: skip
    if as_json:
        console.print_json(json.dumps(report))
    else:
        console.print(table)
        dense = report.get("dense")
        dense_text = (
            f"; {len(dense['modules'])} dense projections at {dense['bits_per_param']:.3f} bits"
            if dense
            else ""
        )
        console.print(
            f"{report['bits_per_param']:.3f} bits per expert parameter "
            f"({report['bytes'].get('lowrank', 0):,} low-rank bytes){dense_text}; wrote {out}"
        )


def _quantize(
    run: Path, out: Path, method: str, bits: int, group_size: int, vq_dim: int, vq_rows: int,
    symmetric: bool,
    act_order: bool, damp: float, group_stats: str, rotate_block: int, lowrank: str, rank: int, grid_text: str | None, sweeps: int,
    lowrank_target: str, weighting: str, min_tokens: int, sequential: bool, dense_bits: int, calib_data: str | None,
    calib_tokens: int,
    seq_len: int | None, batch_size: int, seed: int,
):  # fmt: skip
    from moelab.cli._common import check_source_model, load_run, write_derived_run
    from moelab.compress import (
        calibration_documents,
        calibration_set,
        domain_streams,
        run_data,
    )
    from moelab.compress.progress import TokenProgress
    from moelab.compress.quant import QuantizeConfig, quantize_model
    from moelab.compress.quant.dense import dense_targets, quantize_dense
    from moelab.compress.quant.gptvq import codebook_rows
    from moelab.compress.quant.lowrank import tileq_grid
    from moelab.core.experts.quantized import QuantSpec
    from moelab.models.hooks import moe_layers
    from moelab.train.loop import RUN_FILE, read_run_info, run_train_config
    from moelab.utils.outdir import check_output_folder

    check_output_folder(
        out, inputs=[run], flag=None
    )  # an empty folder (a killed write's) is reusable
    for name, v in (("calib_tokens", calib_tokens), ("batch_size", batch_size)):
        if v < 1:
            raise InvalidValueError(f"{name}: must be >= 1, got {v}")
    grid = parse_grid(grid_text)
    if grid is not None and lowrank not in ("tileq", "tileq-core"):
        raise InvalidValueError(
            f"grid: only used with --lowrank tileq or tileq-core, got --lowrank {lowrank}"
        )
    model, tokenizer = load_run(run)
    check_source_model(model, run, "quantize")
    layers = moe_layers(model)
    if not layers:
        raise InvalidValueError(f"run: {run} has no MoE layer to quantize")
    counts = sorted({layer.config.router.num_experts for layer in layers})
    if lowrank == "tileq" and grid is None:  # one grid for every layer: M·N >= the largest E
        grid = tileq_grid(counts[-1])
    if lowrank == "tileq-core" and grid is None:
        if len(counts) > 1:
            raise InvalidValueError(
                f"grid: tileq-core needs M·N = E in every layer, and the MoE layers have "
                f"{', '.join(map(str, counts))} experts; no single grid fits (use --lowrank tileq)"
            )
        grid = square_grid(counts[0])
    vector = method == "gptvq"
    if vector and not vq_rows:
        widths = {w for lay in layers for w in (lay.config.experts.hidden_size,
                                                lay.config.experts.ffn_hidden_size)}  # fmt: skip
        vq_rows = codebook_rows(bits, vq_dim, group_size, sorted(widths))
    spec = QuantSpec(
        method=method, bits=bits, group_size=group_size, symmetric=symmetric,
        act_order=act_order and method == "gptq" and not rotate_block, lowrank=lowrank,
        rank=0 if lowrank == "none" else rank, grid=grid, rotate_block=rotate_block,
        vq_dim=vq_dim if vector else 0, vq_rows=vq_rows if vector else 0,
    )  # fmt: skip
    cfg = QuantizeConfig(
        spec=spec, damp=damp, group_stats=group_stats, min_tokens=min_tokens, sweeps=sweeps, seed=seed,
        sequential=sequential, target=None if lowrank_target == "auto" else lowrank_target,
        weighting=None if weighting == "auto" else weighting,
    )  # fmt: skip
    for layer in layers:
        ex = layer.config.experts
        spec.check_model(layer.config.router.num_experts, (ex.hidden_size, ex.ffn_hidden_size))
    if dense_bits:
        dense_targets(model, dense_bits, group_size)  # refuse before calibrating
    has_run = run.is_dir() and (run / RUN_FILE).exists()
    S = seq_len or (run_train_config(run).seq_len if has_run else 256)
    if S < 1:
        raise InvalidValueError(f"seq_len: must be >= 1, got {S}")
    S = min(S, model.cfg.max_seq_len)
    streams = domain_streams(calibration_documents(calib_data, run_data(run)), tokenizer)
    calib = calibration_set(
        streams, tokens=calib_tokens, seq_len=S, batch_size=batch_size, seed=seed
    )
    with TokenProgress("calibrating", calib.n_tokens) as bar:
        result = quantize_model(
            model, calib, cfg, on_batch=bar,
            on_pass=lambda label: bar.start_pass(label, calib.n_tokens),
        )  # fmt: skip
    report = result.to_dict()
    if dense_bits:
        report["dense"] = quantize_dense(model, dense_bits, group_size).to_dict()
    report.update(
        source=str(run),
        calibration={"data": calib_data or "held-out documents of the run's training data",
                     "tokens": calib.n_tokens, "seq_len": S, "seed": seed,
                     "sequential": sequential, "domains": list(calib.domain_names)},
        lowrank_target=cfg.lowrank_target,
        weighting=cfg.lowrank_weighting,
    )  # fmt: skip
    write_derived_run(
        out, model, tokenizer, read_run_info(run) if has_run else None, QUANTIZE_FILE, report, run
    )
    return report, _table(run, report)


def _table(run: Path, report: dict) -> Table:
    s = report["spec"]
    lr = "" if s["lowrank"] == "none" else f", {s['lowrank']} rank {s['rank']}"
    table = Table(title=f"{run}: {s['method']} {s['bits']}-bit, group {s['group_size']}{lr}")
    projs = list(report["layers"][0]["quant_error"])
    cols = ["layer", "tokens min/max", "under-cal", *[f"err {p}" for p in projs]]
    if s["lowrank"] != "none":
        cols += [f"+LR {p}" for p in projs]
    cols += ["bits/param"]
    for c in cols:
        table.add_column(c, justify="right")
    for r in report["layers"]:
        row = [str(r["layer"]), f"{min(r['tokens'])}/{max(r['tokens'])}",
               ",".join(map(str, r["under_calibrated"])) or "-",
               *[f"{r['quant_error'][p]:.4f}" for p in projs]]  # fmt: skip
        if s["lowrank"] != "none":
            row += [f"{r['lowrank_error'][p]:.4f}" for p in projs]
        row.append(f"{r['bits_per_param']:.3f}")
        table.add_row(*row)
    return table
