"""Markdown tables of benchmark results (:mod:`moelab.utils.results`) for the docs: one of
per-arm ``mean ± sd`` over seeds, one of paired differences with their t-intervals."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from moelab.utils.results import BenchmarkResult, Stats, load_result


def _as_results(items: Iterable[BenchmarkResult | str | os.PathLike[str]]) -> list[BenchmarkResult]:
    return [r if isinstance(r, BenchmarkResult) else load_result(r) for r in items]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _fmt_stats(st: Stats, fmt: str) -> str:
    if st.sd is None:
        return format(st.mean, fmt)
    return f"{st.mean:{fmt}} ± {st.sd:{fmt}}"


def summary_table(
    results: Iterable[BenchmarkResult | str | os.PathLike[str]],
    metrics: Sequence[str] | None = None,
    *,
    fmt: str = ".3f",
) -> str:
    """Markdown table, one row per (result, arm): seeds and ``mean ± sd`` of each metric.

    Args:
        results: results or paths of result files (read with :func:`load_result`).
        metrics: columns; default every metric of any arm, in first-seen order. A metric an
            arm lacks shows as an empty cell.
        fmt: format spec of the numbers.

    Raises:
        ResultFileError: a path does not hold a valid result.
    """
    loaded = _as_results(results)
    if metrics is None:
        metrics = list(dict.fromkeys(m for r in loaded for a in r.arms for m in r.metric_names(a)))
    lines = [
        "| " + " | ".join(["benchmark", "arm", "seeds", *map(_cell, metrics)]) + " |",
        "|" + "---|" * (3 + len(metrics)),
    ]
    for r in loaded:
        summary = r.summary()
        for arm in r.arms:
            cells = [_fmt_stats(summary[arm][m], fmt) if m in summary[arm] else "" for m in metrics]
            lines.append(
                "| " + " | ".join([_cell(r.name), _cell(arm), str(len(r.seeds)), *cells]) + " |"
            )
    return "\n".join(lines) + "\n"


def paired_table(
    results: Iterable[BenchmarkResult | str | os.PathLike[str]],
    metrics: Sequence[str] | None = None,
    *,
    fmt: str = ".3f",
) -> str:
    """Markdown table, one row per (result, pair, metric): mean difference ``arm - baseline``,
    its sd and t-interval (``[lo, hi]`` at each result's confidence).

    Args:
        results: results or paths of result files.
        metrics: keep only these metrics (default all).
        fmt: format spec of the numbers.

    Raises:
        ResultFileError: a path does not hold a valid result.
    """
    lines = [
        "| benchmark | arm − baseline | metric | seeds | mean diff | sd | CI |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in _as_results(results):
        for p in r.paired():
            if metrics is not None and p.metric not in metrics:
                continue
            st = p.stats
            sd = "" if st.sd is None else format(st.sd, fmt)
            ci = (
                ""
                if st.ci is None
                else f"{round(100 * r.confidence)}% [{st.ci[0]:{fmt}}, {st.ci[1]:{fmt}}]"
            )
            lines.append(
                f"| {_cell(r.name)} | {_cell(p.arm)} − {_cell(p.baseline)} | {_cell(p.metric)} "
                f"| {st.n} | {st.mean:{fmt}} | {sd} | {ci} |"
            )
    return "\n".join(lines) + "\n"
