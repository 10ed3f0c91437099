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

Only :func:`read_result` knows the JSON layout: it is the adapter between the result format and
the renderers, which see the small :class:`Result` view below.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = "moelab.result/1"


class ResultFormatError(ValueError):
    """A result file is missing, not JSON, or not of schema ``moelab.result/1``."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """Mean, sample sd and two-sided t-interval of ``n`` values (sd and ci None when n = 1)."""

    n: int
    mean: float
    sd: float | None
    ci: tuple[float, float] | None


@dataclasses.dataclass(frozen=True)
class Paired:
    """Per-seed differences ``arm - baseline`` of one metric and their statistics."""

    arm: str
    baseline: str
    metric: str
    diffs: tuple[float, ...]
    stats: Stats


@dataclasses.dataclass(frozen=True)
class Result:
    """What the renderers need of one result file."""

    name: str
    method: str
    config: dict[str, Any]
    seeds: tuple[int, ...]
    arms: tuple[str, ...]
    metrics: dict[str, dict[int, dict[str, float]]]  # arm -> seed -> metric -> value
    summary: dict[str, dict[str, Stats]]  # arm -> metric -> stats
    paired: tuple[Paired, ...]
    confidence: float
    commit: str | None
    machine: dict[str, Any]
    extra: dict[str, Any]

    def metric_names(self) -> list[str]:
        """Every metric of any arm, in first-seen order."""
        seen: dict[str, None] = {}
        for arm in self.arms:
            for m in self.metrics[arm][self.seeds[0]]:
                seen.setdefault(m)
        return list(seen)


# --- adapter: the JSON layout of schema moelab.result/1 --------------------------------------


def _stats(obj: dict[str, Any]) -> Stats:
    ci = obj.get("ci")
    return Stats(
        n=int(obj["n"]),
        mean=float(obj["mean"]),
        sd=obj.get("sd"),
        ci=None if ci is None else (float(ci[0]), float(ci[1])),
    )


def read_result(path: str | Path) -> Result:
    """Read one result file (schema ``moelab.result/1``) into a :class:`Result`.

    The summaries and paired differences are taken as stored; the benchmark that wrote the
    file computed them from the per-seed metrics it holds.

    Raises:
        ResultFormatError: the file is missing, not JSON, of another schema, or lacks a field.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFormatError(f"{path}: not a readable JSON result file ({e})") from None
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        found = obj.get("schema") if isinstance(obj, dict) else None
        raise ResultFormatError(f"{path}: schema {found!r}, expected {SCHEMA!r}")
    try:
        provenance = obj["provenance"]
        return Result(
            name=obj["name"],
            method=obj["method"],
            config=obj["config"],
            seeds=tuple(obj["seeds"]),
            arms=tuple(obj["arms"]),
            metrics={
                arm: {int(seed): dict(values) for seed, values in per_seed.items()}
                for arm, per_seed in obj["metrics"].items()
            },
            summary={
                arm: {m: _stats(s) for m, s in per.items()} for arm, per in obj["summary"].items()
            },
            paired=tuple(
                Paired(p["arm"], p["baseline"], p["metric"], tuple(p["diffs"]), _stats(p))
                for p in obj["paired"]
            ),
            confidence=float(obj["confidence"]),
            commit=provenance.get("git_commit"),
            machine=provenance.get("machine", {}),
            extra=obj.get("extra", {}),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ResultFormatError(f"{path}: missing or malformed field ({e!r})") from None


# --- tables -----------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _num(value: float, fmt: str) -> str:
    return format(value, fmt).replace("-", "−")


def _interval(st: Stats, fmt: str) -> str:
    return "" if st.ci is None else f"[{_num(st.ci[0], fmt)}, {_num(st.ci[1], fmt)}]"


def conditions(results: Sequence[Result]) -> str:
    """One line with the conditions shared by ``results`` (seeds, command, machine, commit),
    stated once under a table; conditions that differ are listed per result."""

    def parts(r: Result) -> dict[str, str]:
        out = {"seeds": ", ".join(map(str, r.seeds))}
        if r.extra.get("command"):
            out["command"] = f"`{r.extra['command']}`"
        machine = ", ".join(f"{k} {v}" for k, v in r.machine.items() if v not in (None, ""))
        if machine:
            out["machine"] = machine
        out["commit"] = f"`{r.commit[:7]}`" if r.commit else "not recorded"
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


def seeds_table(result: Result, metrics: Sequence[str] | None = None, fmt: str = ".4f") -> str:
    """Markdown table of every per-seed value: one row per (arm, seed)."""
    metrics = list(metrics or result.metric_names())
    lines = [
        f"**{_cell(result.name)}**",
        "",
        "| arm | seed | " + " | ".join(map(_cell, metrics)) + " |",
        "|---|---:|" + "---:|" * len(metrics),
    ]
    for arm in result.arms:
        for seed in result.seeds:
            values = result.metrics[arm][seed]
            cells = [_num(values[m], fmt) if m in values else "" for m in metrics]
            lines.append(f"| {_cell(arm)} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + conditions([result]) + "\n"


def summary_table(
    results: Sequence[Result], metrics: Sequence[str] | None = None, fmt: str = ".4f"
) -> str:
    """Markdown table, one row per (result, arm): mean ± sd and the t-interval of each metric."""
    if metrics is None:
        metrics = list(dict.fromkeys(m for r in results for m in r.metric_names()))
    level = f"{round(100 * results[0].confidence)} %"
    head = ["result", "arm", "seeds"]
    for m in metrics:
        head += [f"{m} (mean ± sd)", f"{m} {level} interval"]
    lines = [
        "| " + " | ".join(map(_cell, head)) + " |",
        "|---|---|---:|" + "---:|" * 2 * len(metrics),
    ]
    for r in results:
        for arm in r.arms:
            cells = [_cell(r.name), _cell(arm), str(len(r.seeds))]
            for m in metrics:
                st = r.summary[arm].get(m)
                if st is None:
                    cells += ["", ""]
                    continue
                sd = "" if st.sd is None else f" ± {_num(st.sd, fmt)}"
                cells += [_num(st.mean, fmt) + sd, _interval(st, fmt)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + conditions(results) + "\n"


def paired_table(
    results: Sequence[Result], metrics: Sequence[str] | None = None, fmt: str = ".4f"
) -> str:
    """Markdown table, one row per (result, pair, metric): per-seed differences, their mean ±
    sd and t-interval (seeds are the pairing unit)."""
    level = f"{round(100 * results[0].confidence)} %"
    lines = [
        f"| result | arm − baseline | metric | per seed | mean ± sd | {level} interval |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in results:
        for p in r.paired:
            if metrics is not None and p.metric not in metrics:
                continue
            st = p.stats
            per_seed = ", ".join(_num(d, "+" + fmt) for d in p.diffs)
            sd = "" if st.sd is None else f" ± {_num(st.sd, fmt)}"
            lines.append(
                f"| {_cell(r.name)} | {_cell(p.arm)} − {_cell(p.baseline)} | "
                f"{_cell(p.metric)} | {per_seed} | **{_num(st.mean, '+' + fmt)}**{sd} "
                f"| {_interval(st, fmt)} |"
            )
    return "\n".join(lines) + "\n\n" + conditions(results) + "\n"


# --- plots ------------------------------------------------------------------------------------


def _config_value(result: Result, key: str) -> float:
    value: Any = result.config
    for part in key.split("."):
        value = value[part]
    return float(value)


def plot_png(results: Sequence[Result], metric: str, x: str | None = None) -> bytes:
    """A PNG: the metric's mean and t-interval per arm (against config key ``x`` when given,
    else one group of bars), and beside it each pair's mean difference with its interval.

    Needs matplotlib (the ``analysis`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted(results, key=lambda r: _config_value(r, x)) if x else list(results)
    xs = [_config_value(r, x) for r in results] if x else list(range(len(results)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110)

    def err(stats: list[Stats]) -> list[list[float]]:
        return [
            [s.mean - s.ci[0] if s.ci else 0.0 for s in stats],
            [s.ci[1] - s.mean if s.ci else 0.0 for s in stats],
        ]

    arms = list(dict.fromkeys(a for r in results for a in r.arms))
    for arm in arms:
        pts = [
            (xv, r.summary[arm][metric])
            for xv, r in zip(xs, results, strict=True)
            if arm in r.summary and metric in r.summary[arm]
        ]
        if pts:
            stats = [s for _, s in pts]
            left.errorbar(
                [p[0] for p in pts],
                [s.mean for s in stats],
                yerr=err(stats),
                marker="o",
                capsize=3,
                label=arm,
            )
    left.set_ylabel(metric)
    left.set_title(f"{metric}: mean and {round(100 * results[0].confidence)} % interval")
    pairs = list(
        dict.fromkeys((p.arm, p.baseline) for r in results for p in r.paired if p.metric == metric)
    )
    for arm, base in pairs:
        pts = [
            (xv, p.stats)
            for xv, r in zip(xs, results, strict=True)
            for p in r.paired
            if (p.arm, p.baseline, p.metric) == (arm, base, metric)
        ]
        stats = [s for _, s in pts]
        right.errorbar(
            [p[0] for p in pts],
            [s.mean for s in stats],
            yerr=err(stats),
            marker="o",
            capsize=3,
            label=f"{arm} − {base}",
        )
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
    results = [read_result(p) for p in argv]
    for r in results:
        print(seeds_table(r))
    print(summary_table(results))
    print(paired_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
