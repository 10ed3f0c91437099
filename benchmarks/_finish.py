"""The end every claim benchmark shares: make the shared result, render its report, write the
JSON and a markdown copy of the tables, print them.

``report(result) -> (markdown, verdicts)`` is the benchmark's own table-and-claims renderer;
the verdicts go into the result's ``extra["claims"]`` beside the per-run and total times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moelab.utils.atomic import atomic_write_text
from moelab.utils.result_tables import paired_table
from moelab.utils.results import BenchmarkResult, make_result, write_result


def finish(
    name: str,
    settings: dict[str, Any],
    metrics: dict[str, dict[int, dict[str, float]]],
    pairs: Sequence[tuple[str, str]],
    report: Callable[[BenchmarkResult], tuple[str, dict]],
    *,
    seconds: dict[str, dict[str, float]],
    elapsed: float,
    out: Path,
    paired_metrics: Sequence[str],
) -> BenchmarkResult:
    """Write ``out`` (the result, method ``settings["recipe"]``) and ``out`` with ``.md``
    (the report and the paired table of ``paired_metrics``); print both and the wall time."""
    result = make_result(name, settings["recipe"], settings, metrics, pairs=pairs)
    table, verdicts = report(result)
    result = dataclasses.replace(
        result, extra={"run_seconds": seconds, "wall_seconds": elapsed, "claims": verdicts}
    )
    write_result(result, out)
    paired = paired_table([result], list(paired_metrics))
    atomic_write_text(out.with_suffix(".md"), table + "\n" + paired)
    print(table)
    print(paired)
    print(f"wall time {elapsed / 60:.1f} min ({math.ceil(elapsed)} s); result: {out}")
    return result


def mean_sd(values: Sequence[float]) -> str:
    """``"m ± sd"`` (sample sd) to 3 decimals for a report cell; one value alone as itself."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    mean = math.fsum(values) / len(values)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.3f} ± {sd:.3f}"
