"""Markdown tables of benchmark results (:mod:`moelab.utils.results`), as the docs show them:
the per-seed values of one result, per-arm ``mean ± sd`` with the t-interval over seeds, and
paired differences ``arm − baseline`` (per seed, ``mean ± sd``, t-interval).

Numbers are written with ``format(value, fmt)`` and the minus sign ``−`` (U+2212) in place of
the hyphen, as typeset text has it. Interval columns name their level (``95 % interval``), so
the results of one summary or paired table must share their ``confidence``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from moelab.errors import InvalidValueError
from moelab.utils.results import BenchmarkResult, Stats, load_result


def _as_results(items: Iterable[BenchmarkResult | str | os.PathLike[str]]) -> list[BenchmarkResult]:
    return [r if isinstance(r, BenchmarkResult) else load_result(r) for r in items]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _num(value: float, fmt: str) -> str:
    return format(value, fmt).replace("-", "−")


def _sd(st: Stats, fmt: str) -> str:
    return "" if st.sd is None else f" ± {_num(st.sd, fmt)}"


def _interval(st: Stats, fmt: str) -> str:
    return "" if st.ci is None else f"[{_num(st.ci[0], fmt)}, {_num(st.ci[1], fmt)}]"


def _level(results: Sequence[BenchmarkResult]) -> str:
    levels = sorted({r.confidence for r in results})
    if len(levels) != 1:
        found = "no result" if not levels else f"confidences {levels}"
        raise InvalidValueError(f"a result table needs results of one confidence, got {found}")
    return f"{round(100 * levels[0])} %"


def metric_names(results: Iterable[BenchmarkResult]) -> list[str]:
    """Every metric of any arm of ``results``, in first-seen order."""
    return list(dict.fromkeys(m for r in results for a in r.arms for m in r.metric_names(a)))


def seeds_table(
    result: BenchmarkResult | str | os.PathLike[str],
    metrics: Sequence[str] | None = None,
    *,
    fmt: str = ".3f",
) -> str:
    """Markdown table of every per-seed value of one result: one row per (arm, seed).

    Args:
        result: a result or the path of a result file (read with :func:`load_result`).
        metrics: columns; default every metric of any arm, in first-seen order. A metric an
            arm lacks shows as an empty cell.
        fmt: format spec of the numbers.

    Raises:
        ResultFileError: a path does not hold a valid result.
    """
    (r,) = _as_results([result])
    metrics = list(metrics or metric_names([r]))
    lines = [
        "| arm | seed | " + " | ".join(map(_cell, metrics)) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    for arm in r.arms:
        for seed in r.seeds:
            values = r.metrics[arm][seed]
            cells = [_num(values[m], fmt) if m in values else "" for m in metrics]
            lines.append(f"| {_cell(arm)} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_table(
    results: Iterable[BenchmarkResult | str | os.PathLike[str]],
    metrics: Sequence[str] | None = None,
    *,
    fmt: str = ".3f",
) -> str:
    """Markdown table, one row per (result, arm): seeds, then per metric ``mean ± sd`` and the
    t-interval ``[lo, hi]`` (empty with one seed).

    Args:
        results: results or paths of result files (read with :func:`load_result`).
        metrics: columns; default every metric of any arm, in first-seen order. A metric an
            arm lacks shows as empty cells.
        fmt: format spec of the numbers.

    Raises:
        ResultFileError: a path does not hold a valid result.
        InvalidValueError: no results, or results of different ``confidence``.
    """
    loaded = _as_results(results)
    level = _level(loaded)
    if metrics is None:
        metrics = metric_names(loaded)
    head = ["result", "arm", "seeds"]
    for m in metrics:
        head += [f"{m} (mean ± sd)", f"{m} {level} interval"]
    lines = [
        "| " + " | ".join(map(_cell, head)) + " |",
        "|---|---|---:|" + "---:|" * 2 * len(metrics),
    ]
    for r in loaded:
        summary = r.summary()
        for arm in r.arms:
            cells = [_cell(r.name), _cell(arm), str(len(r.seeds))]
            for m in metrics:
                st = summary[arm].get(m)
                cells += (
                    ["", ""]
                    if st is None
                    else [_num(st.mean, fmt) + _sd(st, fmt), _interval(st, fmt)]
                )
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_table(
    results: Iterable[BenchmarkResult | str | os.PathLike[str]],
    metrics: Sequence[str] | None = None,
    *,
    fmt: str = ".3f",
) -> str:
    """Markdown table, one row per (result, pair, metric): the signed per-seed differences
    ``arm − baseline`` (seeds are the pairing unit), their mean (bold, signed) ± sd, and the
    paired t-interval ``[lo, hi]`` (empty with one seed).

    Args:
        results: results or paths of result files.
        metrics: keep only these metrics (default all).
        fmt: format spec of the numbers (signed ones get a ``+``).

    Raises:
        ResultFileError: a path does not hold a valid result.
        InvalidValueError: no results, or results of different ``confidence``.
    """
    loaded = _as_results(results)
    lines = [
        f"| result | arm − baseline | metric | per seed | mean ± sd | {_level(loaded)} interval |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in loaded:
        for p in r.paired():
            if metrics is not None and p.metric not in metrics:
                continue
            cells = [
                _cell(r.name),
                f"{_cell(p.arm)} − {_cell(p.baseline)}",
                _cell(p.metric),
                ", ".join(_num(d, "+" + fmt) for d in p.diffs),
                f"**{_num(p.stats.mean, '+' + fmt)}**" + _sd(p.stats, fmt),
                _interval(p.stats, fmt),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
