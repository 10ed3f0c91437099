"""``moelab analyze``: routing analysis of a run, with plots and an HTML report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, app, console, fail, guarded
from moelab.cli._common import load_run
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError
from moelab.utils.atomic import write_folder_atomically
from moelab.utils.outdir import check_output_folder

ANALYSIS_INPUTS = ("config.json", "model.safetensors", "manifest.json", "run.json")
ANALYSIS_OUTPUTS = ("analysis.json", "plots", "report.html")


@app.command()
def analyze(
    run: Annotated[
        Path, typer.Argument(help="Run folder or model folder (e.g. an imported HF MoE).")
    ],
    data: Annotated[
        str | None, Opt(help="Corpus to route (default: the run's validation split).")
    ] = None,
    tokens: Annotated[int, Opt(help="Tokens per domain to route."), Range(min=1)] = 32_768,
    batch_size: Annotated[int, Opt(help="Sequences per batch."), Range(min=1)] = 8,
    seq_len: Annotated[
        int | None, Opt(help="Context length (default: the run's)."), Range(min=1)
    ] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/analysis).")] = None,
    force: Annotated[
        bool, Opt(help="Replace a non-empty --out (the default RUN/analysis is replaced anyway).")
    ] = False,
) -> None:
    """Routing analysis: load, confidence, co-activation, pathways, specialisation, rank.

    Writes analysis.json, PNG plots and a self-contained report.html.

    Examples:
      moelab analyze runs/main
      moelab analyze runs/main --data shakespeare --tokens 8192 --out /tmp/an
    """
    from rich.progress import Progress

    model, tokenizer = guarded(load_run, run)
    streams, cfg_seq_len = guarded(_analysis_streams, run, data, tokenizer)
    if seq_len is not None and seq_len < 1:
        fail(InvalidValueError(f"seq_len: must be >= 1, got {seq_len}"))
    seq_len = min(seq_len or cfg_seq_len, model.cfg.max_seq_len)
    overwrite = force or out is None
    out = out or run / "analysis"
    inputs = [run / n for n in ANALYSIS_INPUTS] + (
        [Path(data)] if data and Path(data).exists() else []
    )
    guarded(
        check_output_folder,
        out,
        inputs=inputs,
        overwrite=overwrite,
        flag="--force",
        known_outputs=ANALYSIS_OUTPUTS,
    )
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("routing validation text", total=None)
        result, pngs = guarded(_analyze_to, out, model, streams, seq_len, batch_size, tokens, run,
                            lambda: bar.advance(task), overwrite, inputs)  # fmt: skip
    table = Table(title=f"{run}: routing per MoE layer")
    cols = {
        "layer": "layer", "cv": "CV", "max_over_mean": "max/mean", "num_dead": "dead",
        "entropy": "H nats", "normalized_entropy": "H/lnE", "margin": "margin",
        "adjacent_consistency": "adj", "pathway_nmi_next": "path NMI", "domain_nmi": "dom NMI",
        "effective_rank": "eff rank", "redundancy": "cos",
    }  # fmt: skip
    present = [c for c in cols if any(c in row for row in result["headline"])]
    for c in present:
        table.add_column(cols[c], justify="right")
    for row in result["headline"]:
        table.add_row(*(_fmt(row.get(c)) for c in present))
    console.print(table)
    console.print(f"wrote {out / 'analysis.json'}, {len(pngs)} plots and {out / 'report.html'}")


def _analyze_to(
    out: Path, model, streams, seq_len: int, batch_size: int, tokens: int, run: Path, tick,
    overwrite: bool, inputs: list[Path],
):  # fmt: skip
    """Collect routing, compute every metric, write analysis.json, plots and report.html
    (as one folder, atomically, under the output-folder rules)."""
    from moelab.analysis import plot_all, summarize, write_json, write_report
    from moelab.analysis.collect import collect

    got = collect(
        model, streams, seq_len=seq_len, batch_size=batch_size, max_tokens=tokens, on_batch=tick
    )
    result = summarize(
        got.routing, domain_names=got.domain_names, hidden_by_layer=got.hidden_by_layer,
        expert_outputs_by_layer=got.expert_outputs_by_layer,
    )  # fmt: skip

    def fill(tmp: Path) -> list[Path]:
        write_json(result, tmp / "analysis.json")
        pngs = plot_all(result, tmp / "plots")
        write_report(result, pngs, tmp / "report.html", title=f"moelab routing report: {run}")
        return [out / p.relative_to(tmp) for p in pngs]

    pngs = write_folder_atomically(
        out, fill, overwrite, inputs=inputs, flag="--force", known_outputs=ANALYSIS_OUTPUTS
    )
    return result, pngs


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _analysis_streams(run: Path, data: str | None, tokenizer):
    """The run's validation streams per domain (or ``data`` split by domain) and its seq_len."""
    from moelab.data import TokenStream, load_corpus
    from moelab.train.loop import run_train_config, validation_streams

    cfg = run_train_config(run, need_data=data is None)
    if data is None:
        return validation_streams(cfg, tokenizer), cfg.seq_len
    docs = load_corpus(data)
    names = sorted({d.domain for d in docs})
    streams = {
        n: TokenStream.from_documents(
            [d for d in docs if d.domain == n], tokenizer, domain_names=names, name=n
        )
        for n in names
    }
    return streams, cfg.seq_len
