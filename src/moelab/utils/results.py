"""The one result format every benchmark and recipe writes: per-seed metrics of one or more
arms, their mean ± sd over seeds, and paired differences between arms with t-intervals.

A :class:`BenchmarkResult` holds what was run (name, method, config, seeds, arms), what came
out (``metrics[arm][seed][metric]``), which arms are compared (``pairs``: ``(arm, baseline)``)
and where it ran (:class:`Provenance`: git commit, dirty flag, time, machine). Summaries and
paired differences are derived from the per-seed metrics, never stored on their own: a file
carries them for readers, and :func:`load_result` recomputes them and refuses a file whose
stored ones disagree (an edited or stale file).

Statistics (Student's t; e.g. Wasserman, *All of Statistics*, §6.3.2 and §10.6):

* per arm and metric over the n seeds: mean, sample sd (``ddof=1``) and the two-sided
  ``confidence`` t-interval ``mean ± t_{(1+c)/2, n-1} · sd / √n`` (:func:`t_interval`);
* per pair ``(arm, baseline)`` and metric present in both: the paired differences
  ``d_s = metrics[arm][s][m] - metrics[baseline][s][m]`` over the seeds, and the same
  statistics of ``d`` (the paired t-interval: seeds are the pairing unit, so a recipe must
  give both arms of one seed the same data split, class order and initial weights).

With one seed, ``sd`` and the interval are ``null``.

**NaN and infinite metrics are refused** (:class:`~moelab.errors.InvalidValueError` naming
the arm, seed and metric): a mean or a paired difference over a seed set that silently lost
one seed is biased, and strict JSON has no NaN. A recipe whose run can diverge reports that
as a finite metric of its own (e.g. ``diverged: 1.0``) beside finite values.

JSON layout (schema ``"moelab.result/1"``; seeds are object keys, hence strings)::

    {
      "schema": "moelab.result/1",
      "name": "care_wordnet",              # the benchmark (or run) name
      "method": "care",                    # the method under test
      "config": {...},                     # any JSON object: the settings of the run
      "seeds": [0, 1, 2],
      "arms": ["care", "simplecil"],       # arms[0] is the method, the others baselines
      "pairs": [["care", "simplecil"]],    # differences arm - baseline
      "confidence": 0.95,
      "metrics": {"care": {"0": {"acc": 0.71, ...}, "1": {...}, "2": {...}}, "simplecil": {...}},
      "summary": {"care": {"acc": {"n": 3, "mean": .., "sd": .., "ci": [lo, hi]}}, ...},
      "paired": [{"arm": "care", "baseline": "simplecil", "metric": "acc",
                  "diffs": [d0, d1, d2], "n": 3, "mean": .., "sd": .., "ci": [lo, hi]}],
      "extra": {...},                      # free JSON (curves, timings); not checked
      "provenance": {"git_commit": "7e43875..." | null, "git_dirty": false | null,
                     "created": "2026-01-01T12:00:00+00:00",
                     "machine": {"platform": .., "python": .., "cpu_count": ..,
                                 "torch": .. | null, "torch_threads": .. | null, ...}}
    }

Every arm has every seed, and within one arm every seed has the same metric names. Pairs
cover the metrics both arms have. :mod:`moelab.utils.result_tables` renders results as
markdown tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scipy import stats as _scipy_stats

from moelab.errors import InvalidTypeError, InvalidValueError, UserError
from moelab.utils.atomic import atomic_write_json

SCHEMA = "moelab.result/1"
"""Schema id written into (and required of) every result file."""

_SCHEMA_PREFIX = "moelab.result/"
_TOLERANCE = 1e-9  # relative: stored derived numbers vs recomputed ones (scipy versions differ)


class ResultFileError(UserError, ValueError):
    """A result file is missing, not JSON, of another schema version, or has a bad field;
    the one-line message names the file and the field."""


class ResultFieldError(InvalidValueError):
    """A field of a :class:`BenchmarkResult` breaks its rules; ``field`` is its dotted path
    (e.g. ``metrics.care.1.acc``) and ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"benchmark result field {field!r}: {reason}")
        self.field = field
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Stats:
    """Mean, sample sd and two-sided t-interval of ``n`` values (``sd``/``ci`` None if n = 1)."""

    n: int
    mean: float
    sd: float | None
    ci: tuple[float, float] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "mean": self.mean,
            "sd": self.sd,
            "ci": None if self.ci is None else list(self.ci),
        }


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """Paired differences ``arm - baseline`` of one metric, in seed order, and their stats."""

    arm: str
    baseline: str
    metric: str
    diffs: tuple[float, ...]
    stats: Stats

    def to_json(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "baseline": self.baseline,
            "metric": self.metric,
            "diffs": list(self.diffs),
            **self.stats.to_json(),
        }


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Stats:
    """Mean, sample sd (``ddof=1``) and Student-t interval of ``values``.

    ``ci = mean ± t_{(1+confidence)/2, n-1} · sd / √n`` (``scipy.stats.t.ppf``); e.g. the
    values ``[1, 2, 3]`` give mean 2, sd 1 and ``2 ± 4.3027 / √3``.

    Raises:
        InvalidValueError: ``values`` is empty or holds a non-finite number, or
            ``confidence`` is not in (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise InvalidValueError(f"confidence must be in (0, 1), got {confidence!r}")
    xs = [float(v) for v in values]
    if not xs or not all(math.isfinite(x) for x in xs):
        raise InvalidValueError(f"t_interval needs one or more finite values, got {xs!r}")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n == 1:
        return Stats(n=1, mean=mean, sd=None, ci=None)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(_scipy_stats.t.ppf((1.0 + confidence) / 2.0, n - 1)) * sd / math.sqrt(n)
    return Stats(n=n, mean=mean, sd=sd, ci=(mean - half, mean + half))


def bootstrap_interval(
    values: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (Efron & Tibshirani 1993,
    §13.3): ``resamples`` means of ``n`` values drawn with replacement (a NumPy generator
    seeded by ``seed``, so the interval is reproducible), and their ``(1−c)/2`` and
    ``(1+c)/2`` quantiles. With paired per-seed differences it makes no normality
    assumption, unlike :func:`t_interval`; with few seeds it is coarse (n = 3 has only 10
    distinct resample means) and narrower than the t-interval, so report both.

    Raises:
        InvalidValueError: ``values`` empty or non-finite, ``confidence`` not in (0, 1), or
            ``resamples`` not an int >= 1.
    """
    import numpy as np

    if not 0.0 < confidence < 1.0:
        raise InvalidValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise InvalidValueError(f"resamples must be an int >= 1, got {resamples!r}")
    xs = np.asarray([float(v) for v in values], dtype=np.float64)
    if xs.size == 0 or not np.isfinite(xs).all():
        raise InvalidValueError(f"bootstrap_interval needs finite values, got {xs.tolist()!r}")
    rng = np.random.default_rng(seed)
    means = xs[rng.integers(0, xs.size, size=(resamples, xs.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where and when a result was made.

    Attributes:
        git_commit: ``git rev-parse HEAD`` of the moelab checkout, None outside one.
        git_dirty: tracked files differ from that commit (``git status --porcelain
            --untracked-files=no``), None outside a checkout.
        created: ISO 8601 UTC time of creation.
        machine: :func:`machine_info` at creation.
    """

    git_commit: str | None
    git_dirty: bool | None
    created: str
    machine: dict[str, Any]

    @classmethod
    def current(cls) -> Provenance:
        """The provenance of a result made now, in this process."""
        commit, dirty = git_state()
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(git_commit=commit, git_dirty=dirty, created=now, machine=machine_info())

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_state() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout moelab is imported from, or ``(None, None)``.

    Only a checkout whose ``src/moelab`` is this very package counts: an installed moelab
    inside some other repository (a user's project with a venv) reports ``(None, None)``.
    """
    package = Path(__file__).resolve().parents[1]
    top = _git(["rev-parse", "--show-toplevel"], package)
    if top is None or Path(top.strip()).resolve() / "src" / "moelab" != package:
        return None, None
    commit = _git(["rev-parse", "HEAD"], package)
    status = _git(["status", "--porcelain", "--untracked-files=no"], package)
    if commit is None or status is None:
        return None, None
    return commit.strip(), bool(status.strip())


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Platform, Python, CPU count, OMP_NUM_THREADS, numpy/torch versions, torch threads and
    CUDA device; torch is only queried when already imported (this module never imports it)."""
    torch = sys.modules.get("torch")
    device = None
    if torch is not None and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cuda_device": device,
    }


def _require(cond: bool, field: str, reason: str) -> None:
    if not cond:
        raise ResultFieldError(field, reason)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _check_json_object(value: Any, field: str) -> dict[str, Any]:
    _require(isinstance(value, dict), field, f"must be a JSON object, got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ResultFieldError(field, f"is not plain JSON ({e})") from None
    return value


def check_metrics(values: Mapping[str, Any], field: str) -> None:
    """Check one run's metrics: a non-empty mapping of non-empty names to finite numbers.

    Raises:
        ResultFieldError: the first bad entry, named ``{field}.{metric}``.
    """
    _require(isinstance(values, Mapping), field, f"must be a mapping, got {type(values).__name__}")
    _require(len(values) > 0, field, "has no metric")
    for metric, value in values.items():
        _require(_is_name(metric), field, f"bad metric name {metric!r}")
        where = f"{field}.{metric}"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _require(ok, where, f"must be a number, got {value!r}")
        _require(math.isfinite(value), where, f"must be finite, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Per-seed metrics of one or more arms (see the module docstring for the JSON layout).

    Attributes:
        name: benchmark or run name (non-empty).
        method: the method under test (non-empty).
        config: JSON object of the run's settings.
        seeds: distinct ints, in run order.
        arms: distinct non-empty names; ``arms[0]`` is the method.
        metrics: ``metrics[arm][seed][metric]``, finite numbers (not bool), every arm × seed, one
            metric-name set per arm.
        pairs: ``(arm, baseline)`` pairs of distinct arms; differences are arm - baseline.
        provenance: git commit, time, machine.
        confidence: level of the t-intervals, in (0, 1).
        extra: free JSON object (curves, timings), not interpreted.

    Raises (construction):
        ResultFieldError: (an ``InvalidValueError``) a field breaks the rules above; the
            message names it (e.g. ``metrics.care.1.acc``).
        InvalidTypeError: ``provenance`` is not a :class:`Provenance`.
    """

    name: str
    method: str
    config: dict[str, Any]
    seeds: tuple[int, ...]
    arms: tuple[str, ...]
    metrics: dict[str, dict[int, dict[str, float]]]
    pairs: tuple[tuple[str, str], ...]
    provenance: Provenance
    confidence: float = 0.95
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.provenance, Provenance):
            raise InvalidTypeError(
                f"benchmark result field 'provenance': must be a Provenance, "
                f"got {type(self.provenance).__name__}"
            )
        _require(_is_name(self.name), "name", f"must be a non-empty string, got {self.name!r}")
        _require(
            _is_name(self.method), "method", f"must be a non-empty string, got {self.method!r}"
        )
        _check_json_object(self.config, "config")
        _check_json_object(self.extra, "extra")
        conf = self.confidence
        _require(
            isinstance(conf, float) and 0.0 < conf < 1.0,
            "confidence",
            f"must be a float in (0, 1), got {conf!r}",
        )
        seeds = self.seeds
        _require(
            isinstance(seeds, tuple)
            and len(seeds) > 0
            and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds),
            "seeds",
            f"must be a non-empty tuple of ints, got {seeds!r}",
        )
        _require(len(set(seeds)) == len(seeds), "seeds", f"has duplicates: {list(seeds)}")
        arms = self.arms
        _require(
            isinstance(arms, tuple) and len(arms) > 0 and all(_is_name(a) for a in arms),
            "arms",
            f"must be a non-empty tuple of non-empty names, got {arms!r}",
        )
        _require(len(set(arms)) == len(arms), "arms", f"has duplicates: {list(arms)}")
        _require(isinstance(self.metrics, dict), "metrics", "must be a dict arm -> seed -> dict")
        _require(
            set(self.metrics) == set(arms),
            "metrics",
            f"has arms {sorted(self.metrics)}, expected {list(arms)}",
        )
        for arm in arms:
            per_seed = self.metrics[arm]
            field = f"metrics.{arm}"
            _require(isinstance(per_seed, dict), field, "must be a dict seed -> metrics")
            _require(
                set(per_seed) == set(seeds),
                field,
                f"has seeds {sorted(per_seed, key=str)}, expected {list(seeds)}",
            )
            names = None
            for seed in seeds:
                values = per_seed[seed]
                sfield = f"{field}.{seed}"
                _require(isinstance(values, dict), sfield, "must be a dict metric -> number")
                check_metrics(values, sfield)
                if names is None:
                    names = set(values)
                _require(
                    set(values) == names,
                    sfield,
                    f"has metrics {sorted(values)}, but seed {seeds[0]} has {sorted(names)}",
                )
        _require(isinstance(self.pairs, tuple), "pairs", "must be a tuple of (arm, baseline)")
        for i, pair in enumerate(self.pairs):
            ok = (
                isinstance(pair, tuple)
                and len(pair) == 2
                and pair[0] in arms
                and pair[1] in arms
                and pair[0] != pair[1]
            )
            _require(ok, f"pairs.{i}", f"must be two distinct arms of {list(arms)}, got {pair!r}")

    def metric_names(self, arm: str) -> list[str]:
        """The metric names of ``arm``, in the order its first seed reported them."""
        return list(self.metrics[arm][self.seeds[0]])

    def summary(self) -> dict[str, dict[str, Stats]]:
        """``summary[arm][metric]``: :class:`Stats` of the metric over the seeds."""
        return {
            arm: {
                m: t_interval([self.metrics[arm][s][m] for s in self.seeds], self.confidence)
                for m in self.metric_names(arm)
            }
            for arm in self.arms
        }

    def paired(self) -> list[PairedDifference]:
        """Paired differences for every pair and every metric both arms report."""
        out = []
        for arm, base in self.pairs:
            common = [m for m in self.metric_names(arm) if m in self.metrics[base][self.seeds[0]]]
            for m in common:
                diffs = tuple(
                    self.metrics[arm][s][m] - self.metrics[base][s][m] for s in self.seeds
                )
                out.append(
                    PairedDifference(arm, base, m, diffs, t_interval(diffs, self.confidence))
                )
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the module docstring (derived sections included)."""
        return {
            "schema": SCHEMA,
            "name": self.name,
            "method": self.method,
            "config": self.config,
            "seeds": list(self.seeds),
            "arms": list(self.arms),
            "pairs": [list(p) for p in self.pairs],
            "confidence": self.confidence,
            "metrics": {
                arm: {str(s): dict(self.metrics[arm][s]) for s in self.seeds} for arm in self.arms
            },
            "summary": {
                arm: {m: st.to_json() for m, st in per.items()}
                for arm, per in self.summary().items()
            },
            "paired": [p.to_json() for p in self.paired()],
            "extra": self.extra,
            "provenance": self.provenance.to_json(),
        }


def make_result(
    name: str,
    method: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, Mapping[int, Mapping[str, float]]],
    *,
    pairs: Iterable[tuple[str, str]] | None = None,
    confidence: float = 0.95,
    extra: Mapping[str, Any] | None = None,
) -> BenchmarkResult:
    """A :class:`BenchmarkResult` made now: seeds and arms in ``metrics``' order, provenance
    of this process, and (default) ``pairs`` = ``arms[0]`` against every other arm.

    Args:
        metrics: ``{arm: {seed: {metric: value}}}``; every arm must have the same seeds.

    Raises:
        InvalidValueError / InvalidTypeError: see :class:`BenchmarkResult`.
    """
    arms = tuple(metrics)
    if not arms:
        raise InvalidValueError("benchmark result field 'metrics': has no arm")
    seeds = tuple(metrics[arms[0]])
    if pairs is None:
        pairs = [(arms[0], other) for other in arms[1:]]
    return BenchmarkResult(
        name=name,
        method=method,
        config=dict(config),
        seeds=seeds,
        arms=arms,
        metrics={a: {s: dict(v) for s, v in metrics[a].items()} for a in arms},
        pairs=tuple(tuple(p) for p in pairs),
        provenance=Provenance.current(),
        confidence=float(confidence),
        extra=dict(extra or {}),
    )


def write_result(result: BenchmarkResult, path: str | os.PathLike[str]) -> Path:
    """Write ``result`` as JSON to ``path`` atomically; returns the path.

    Raises:
        DiskFullError: the disk filled up (nothing is written).
    """
    return atomic_write_json(path, result.to_json())


def _get(obj: dict[str, Any], key: str, kind: Any, what: str, prefix: str = "") -> Any:
    _require(key in obj, prefix + key, "is missing")
    value = obj[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind))
    _require(ok, prefix + key, f"must be {what}, got {type(value).__name__}")
    return value


def _kinds(kind: Any) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _parse_seed(key: str, field: str) -> int:
    try:
        seed = int(key)
    except ValueError:
        seed = None
    _require(seed is not None and str(seed) == key, field, f"bad seed key {key!r}")
    return seed


def _from_json(obj: Any) -> BenchmarkResult:
    _require(isinstance(obj, dict), "(top level)", "must be a JSON object")
    schema = _get(obj, "schema", str, "a string")
    _require(schema.startswith(_SCHEMA_PREFIX), "schema", f"not a moelab result ({schema!r})")
    _require(schema == SCHEMA, "schema", f"version {schema!r} is not supported (need {SCHEMA!r})")
    metrics: dict[str, dict[int, dict[str, float]]] = {}
    for arm, per_seed in _get(obj, "metrics", dict, "an object").items():
        _require(isinstance(per_seed, dict), f"metrics.{arm}", "must be an object")
        metrics[arm] = {_parse_seed(k, f"metrics.{arm}"): v for k, v in per_seed.items()}
    prov = _get(obj, "provenance", dict, "an object")
    pre = "provenance."
    provenance = Provenance(
        git_commit=_get(prov, "git_commit", (str, type(None)), "a string or null", pre),
        git_dirty=_get(prov, "git_dirty", (bool, type(None)), "a boolean or null", pre),
        created=_get(prov, "created", str, "a string", pre),
        machine=_get(prov, "machine", dict, "an object", pre),
    )
    pairs = _get(obj, "pairs", list, "a list")
    result = BenchmarkResult(
        name=_get(obj, "name", str, "a string"),
        method=_get(obj, "method", str, "a string"),
        config=_get(obj, "config", dict, "an object"),
        seeds=tuple(_get(obj, "seeds", list, "a list")),
        arms=tuple(_get(obj, "arms", list, "a list")),
        metrics=metrics,
        pairs=tuple(tuple(p) if isinstance(p, list) else p for p in pairs),
        provenance=provenance,
        confidence=float(_get(obj, "confidence", (int, float), "a number")),
        extra=_get(obj, "extra", dict, "an object"),
    )
    fresh = result.to_json()
    for key in ("summary", "paired"):
        _require(key in obj, key, "is missing")
        _require(
            _close(obj[key], fresh[key]),
            key,
            "does not match the per-seed metrics (an edited or stale file)",
        )
    return result


def _close(stored: Any, fresh: Any) -> bool:
    """JSON values equal up to a relative 1e-9 on numbers (scipy's t quantiles may differ
    in the last bits between versions)."""
    if isinstance(fresh, dict):
        return (
            isinstance(stored, dict)
            and stored.keys() == fresh.keys()
            and all(_close(stored[k], v) for k, v in fresh.items())
        )
    if isinstance(fresh, list):
        return (
            isinstance(stored, list)
            and len(stored) == len(fresh)
            and all(_close(a, b) for a, b in zip(stored, fresh, strict=True))
        )
    if isinstance(fresh, float) and isinstance(stored, (int, float)):
        return not isinstance(stored, bool) and math.isclose(
            stored, fresh, rel_tol=_TOLERANCE, abs_tol=1e-12
        )
    return type(stored) is type(fresh) and stored == fresh


def load_result(path: str | os.PathLike[str]) -> BenchmarkResult:
    """Read and check a result file written by :func:`write_result`.

    Raises:
        ResultFileError: the file is missing, not JSON, of another schema version, lacks a
            field, has a field of the wrong type or value, or its summary/paired sections
            disagree with its per-seed metrics. One line: ``"<path>: field 'x': why"``.
    """
    path = Path(path)
    if not path.is_file():
        raise ResultFileError(f"{path}: result file not found")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFileError(f"{path}: not a valid JSON result file ({e})") from None
    try:
        return _from_json(obj)
    except ResultFieldError as e:
        raise ResultFileError(f"{path}: field {e.field!r}: {e.reason}") from None


__all__ = [
    "SCHEMA",
    "BenchmarkResult",
    "PairedDifference",
    "Provenance",
    "ResultFieldError",
    "ResultFileError",
    "Stats",
    "bootstrap_interval",
    "check_metrics",
    "git_state",
    "load_result",
    "machine_info",
    "make_result",
    "t_interval",
    "write_result",
]
