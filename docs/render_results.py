"""Tables and plots for the documentation, rendered from benchmark result files.

Every benchmark writes its results as JSON in the shared result format (schema
``moelab.result/1``: per-seed metrics of one or more arms, their summaries, and paired
differences between arms with t-intervals). The files the documentation shows live in
``docs/results/``; the MkDocs hook ``docs/hooks/results.py`` replaces a directive line in a page
with the rendered table or plot, so re-running a benchmark and copying its JSON there updates the
page. Directives (one per line, names are file names in ``docs/results/`` without ``.json``)::

    <!-- result:seeds NAME -->                       per-seed values of every arm
    <!-- result:summary NAME [NAME ...] -->          mean ± sd and 95 % interval per arm
    <!-- result:paired NAME [NAME ...] -->           paired differences arm − baseline
    <!-- result:plot NAME [NAME ...] metric=M x=K --> mean and interval per arm against
                                                     config key K, and the paired difference

Options (``key=value``, no spaces): ``metrics=a,b`` keeps those metrics, ``fmt=.3f`` sets the
number format, ``x=`` names the config key of the plot's horizontal axis.

As a script it prints the tables of result files::

    python docs/render_results.py docs/results/moe_vs_dense_380s.json

Files are read with :func:`moelab.utils.results.load_result` (which checks the schema and
recomputes the summaries and paired differences from the per-seed metrics) and the tables are
those of :mod:`moelab.utils.result_tables`; this module adds what is particular to the pages: a
title over each per-seed table, the line of conditions under every table, and the plots.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from typing import Any

from moelab.utils import result_tables as tables
from moelab.utils.results import BenchmarkResult, Stats, load_result


def conditions(results: Sequence[BenchmarkResult]) -> str:
    """One line with the conditions shared by ``results`` (seeds, command, machine, commit),
    stated once under a table; conditions that differ are listed per result."""

    def parts(r: BenchmarkResult) -> dict[str, str]:
        out = {"seeds": ", ".join(map(str, r.seeds))}
        if r.extra.get("command"):
            out["command"] = f"`{r.extra['command']}`"
        machine = r.provenance.machine
        machine = ", ".join(f"{k} {v}" for k, v in machine.items() if v not in (None, ""))
        if machine:
            out["machine"] = machine
        commit = r.provenance.git_commit
        out["commit"] = f"`{commit[:7]}`" if commit else "not recorded"
        if r.extra.get("note"):
            out["note"] = str(r.extra["note"])
        return out

    per = [parts(r) for r in results]
    keys = list(dict.fromkeys(k for p in per for k in p))
    shared = [k for k in keys if all(p.get(k) == per[0].get(k) for p in per)]
    line = "; ".join(f"{k}: {per[0][k]}" for k in shared if k in per[0])
    varying = [k for k in keys if k not in shared]
    for r, p in zip(results, per, strict=True):
        own = "; ".join(f"{k}: {p[k]}" for k in varying if k in p)
        if own:
            line += f"; {r.name}: {own}"
    return f"*Conditions — {line}.*"


def seeds_table(
    result: BenchmarkResult, metrics: Sequence[str] | None = None, fmt: str = ".4f"
) -> str:
    """The result's name, its per-seed table (one row per arm and seed) and its conditions."""
    table = tables.seeds_table(result, metrics, fmt=fmt)
    return f"**{result.name}**\n\n{table}\n{conditions([result])}\n"


def summary_table(
    results: Sequence[BenchmarkResult], metrics: Sequence[str] | None = None, fmt: str = ".4f"
) -> str:
    """Mean ± sd and t-interval per (result, arm) and metric, then the conditions."""
    return f"{tables.summary_table(results, metrics, fmt=fmt)}\n{conditions(results)}\n"


def paired_table(
    results: Sequence[BenchmarkResult], metrics: Sequence[str] | None = None, fmt: str = ".4f"
) -> str:
    """Per-seed differences arm − baseline, their mean ± sd and t-interval, then the
    conditions."""
    return f"{tables.paired_table(results, metrics, fmt=fmt)}\n{conditions(results)}\n"


# --- plots ------------------------------------------------------------------------------------


def _config_value(result: BenchmarkResult, key: str) -> float:
    value: Any = result.config
    for part in key.split("."):
        value = value[part]
    return float(value)


def _errorbar(ax: Any, points: list[tuple[float, Stats]], label: str) -> None:
    """Means at their x with the t-interval as error bars (none for a single seed)."""
    stats = [s for _, s in points]
    ax.errorbar(
        [x for x, _ in points],
        [s.mean for s in stats],
        yerr=[
            [s.mean - s.ci[0] if s.ci else 0.0 for s in stats],
            [s.ci[1] - s.mean if s.ci else 0.0 for s in stats],
        ],
        marker="o",
        capsize=3,
        label=label,
    )


def plot_png(results: Sequence[BenchmarkResult], metric: str, x: str | None = None) -> bytes:
    """A PNG: the metric's mean and t-interval per arm (against config key ``x`` when given,
    else one group of bars), and beside it each pair's mean difference with its interval.

    Needs matplotlib (the ``analysis`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: _config_value(r, x)) if x else list(results)
    xs = [_config_value(r, x) for r in results] if x else list(range(len(results)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)

    summaries = [r.summary() for r in results]
    paired = [r.paired() for r in results]
    arms = list(dict.fromkeys(a for r in results for a in r.arms))
    for arm in arms:
        pts = [
            (xv, summary[arm][metric])
            for xv, summary in zip(xs, summaries, strict=True)
            if arm in summary and metric in summary[arm]
        ]
        if pts:
            _errorbar(left, pts, arm)
    left.set_ylabel(metric)
    left.set_title(f"{metric}: mean and {round(100 * results[0].confidence)} % interval")
    pairs = list(
        dict.fromkeys((p.arm, p.baseline) for ps in paired for p in ps if p.metric == metric)
    )
    for arm, base in pairs:
        pts = [
            (xv, p.stats)
            for xv, ps in zip(xs, paired, strict=True)
            for p in ps
            if (p.arm, p.baseline, p.metric) == (arm, base, metric)
        ]
        _errorbar(right, pts, f"{arm} − {base}")
    right.axhline(0.0, color="grey", linewidth=0.8)
    right.set_title("paired difference: mean and interval")
    for ax in (left, right):
        if x:
            ax.set_xlabel(x.rsplit(".", 1)[-1])
            ax.set_xticks(xs)
        else:
            ax.set_xticks(xs, [r.name for r in results], rotation=20, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    results = [load_result(p) for p in argv]
    for r in results:
        print(seeds_table(r))
    print(summary_table(results))
    print(paired_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
