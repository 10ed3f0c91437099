"""Time series with text for forecasting: the real ``taylor`` electricity demand, user CSVs of
(timestamp, value, text), sliding windows and a chronological split.

``taylor``: half-hourly electricity demand of England and Wales (megawatts), Monday 5 June to
Sunday 27 August 2000, 4,032 values (Taylor 2003, *J. Oper. Res. Soc.* 54:799-805; R's
``forecast::taylor``). The values are the array literal in ``pmdarima/datasets/taylor.py`` of
the ``pmdarima`` wheel (MIT); the file is **read as text, never imported** (pmdarima needs
pandas and compiled extensions). Install with ``pip install --no-deps pmdarima==2.1.1``.

A user CSV has a header with the columns ``timestamp``, ``value`` and ``text`` (any order,
other columns ignored), one row per time step in time order; ``text`` may be empty. The text
of a window is the one at its forecast origin (the last look-back step): what was known when
the forecast was made.
"""

from __future__ import annotations

import ast
import csv
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data.corpora import package_dir
from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.errors import InvalidValueError

TAYLOR_INSTALL = "pip install --no-deps pmdarima==2.1.1"
TAYLOR_LENGTH = 4032
_ARRAY = re.compile(r"np\.array\(\s*(\[[0-9,\s.]*\])\s*\)")


def parse_taylor_source(source: str) -> np.ndarray:
    """The values of the one ``np.array([...])`` literal in the text of pmdarima's
    ``taylor.py`` → ``[4032]`` float64 (megawatts).

    Raises:
        CorpusError: no such literal, or not 4,032 numbers.
    """
    match = _ARRAY.search(source)
    if match is None:
        raise CorpusError("taylor: no np.array([...]) literal in the source text")
    values = np.asarray(ast.literal_eval(match.group(1)), dtype=np.float64)
    if values.shape != (TAYLOR_LENGTH,):
        raise CorpusError(f"taylor: expected {TAYLOR_LENGTH} values, found {values.size}")
    return values


def load_taylor() -> np.ndarray:
    """The ``taylor`` series ``[4032]`` float64 (megawatts, half-hourly from 5 June 2000 00:00).

    Raises:
        CorpusNotInstalledError: pmdarima is not installed (the message says how).
        CorpusError: the file is missing or holds no 4,032-value array.
    """
    path = package_dir("pmdarima", "taylor", TAYLOR_INSTALL) / "datasets" / "taylor.py"
    if not path.is_file():
        raise CorpusNotInstalledError(f"taylor: {path} is missing; reinstall: {TAYLOR_INSTALL}")
    return parse_taylor_source(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class TextSeries:
    """One series with a text per step.

    Attributes:
        values: ``[n]`` float64.
        texts: ``n`` strings (``""`` = no text at that step).
        timestamps: ``n`` strings as read (not parsed).
    """

    values: np.ndarray
    texts: tuple[str, ...]
    timestamps: tuple[str, ...]


def load_series_csv(path: str | os.PathLike[str]) -> TextSeries:
    """Read a CSV with the columns ``timestamp``, ``value``, ``text``.

    Raises:
        CorpusError: the file is missing or unreadable, a column is missing, a value is not a
            finite number (names the line), or there are no rows.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
            fields = set(rows[0]) if rows else set()
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CorpusError(f"{path}: cannot read ({e})") from None
    if not rows:
        raise CorpusError(f"{path}: no data rows")
    missing = sorted({"timestamp", "value", "text"} - fields)
    if missing:
        raise CorpusError(f"{path}: missing column {missing[0]!r} (need timestamp, value, text)")
    values = np.empty(len(rows))
    for i, row in enumerate(rows):
        try:
            values[i] = float(row["value"])
        except (TypeError, ValueError):
            values[i] = math.nan
        if not math.isfinite(values[i]):
            raise CorpusError(f"{path}:{i + 2}: value {row['value']!r} is not a finite number")
    return TextSeries(
        values,
        tuple((r["text"] or "").strip() for r in rows),
        tuple(r["timestamp"] or "" for r in rows),
    )


def window_starts(length: int, lookback: int, horizon: int, stride: int) -> np.ndarray:
    """``[N]`` int64 start indices of every window of ``lookback + horizon`` steps that fits
    in a series of ``length`` steps, ``stride`` apart.

    Raises:
        InvalidValueError: a size < 1, or the series is shorter than one window.
    """
    for name, v in (("lookback", lookback), ("horizon", horizon), ("stride", stride)):
        if v < 1:
            raise InvalidValueError(f"{name}: must be >= 1, got {v}")
    span = lookback + horizon
    if length < span:
        raise InvalidValueError(
            f"series: {length} steps is shorter than one window (lookback {lookback} + "
            f"horizon {horizon})"
        )
    return np.arange(0, length - span + 1, stride, dtype=np.int64)


def chronological_split(n: int, fractions: tuple[float, float, float]) -> tuple[slice, ...]:
    """Three consecutive slices (train, validation, test) of ``n`` time-ordered windows;
    the validation and test sizes are ``round(n·f)``, train gets the rest.

    Raises:
        InvalidValueError: fractions not positive or not summing to 1, or a part is empty.
    """
    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-9:
        raise InvalidValueError(f"fractions: three positive numbers summing to 1, got {fractions}")
    n_val, n_test = round(n * fractions[1]), round(n * fractions[2])
    n_train = n - n_val - n_test
    if min(n_train, n_val, n_test) < 1:
        raise InvalidValueError(f"fractions: {n} windows leave an empty split ({fractions})")
    return slice(0, n_train), slice(n_train, n_train + n_val), slice(n_train + n_val, n)


@dataclass(frozen=True)
class WindowSet:
    """Windows of one split.

    Attributes:
        x: ``[N, L]`` float32 look-back values, scaled (``(v − mean) / std`` of the train part).
        y: ``[N, H]`` float32 horizon values, scaled the same way.
        text_id: ``[N]`` int64 index of each window's text in :attr:`ForecastData.texts`.
        event: ``[N]`` int64 index of each window's event type in
            :attr:`ForecastData.event_names` (0 = no event).
        start: ``[N]`` int64 index of each window's first step in the series.
    """

    x: np.ndarray
    y: np.ndarray
    text_id: np.ndarray
    event: np.ndarray
    start: np.ndarray

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, index: np.ndarray | slice) -> WindowSet:
        """The windows ``index`` selects (a slice or an index array), every field alike."""
        return WindowSet(
            self.x[index], self.y[index], self.text_id[index], self.event[index], self.start[index]
        )


@dataclass(frozen=True)
class ForecastData:
    """Train, validation and test windows with their texts.

    Attributes:
        texts: the distinct strings the windows refer to.
        event_names: the event types (``event_names[0]`` is ``"none"``).
        mean, std: the scaling of the values (train look-backs), in the series' units.
    """

    train: WindowSet
    val: WindowSet
    test: WindowSet
    texts: tuple[str, ...]
    event_names: tuple[str, ...]
    mean: float
    std: float


def scale_windows(
    x: np.ndarray,
    y: np.ndarray,
    text_id: np.ndarray,
    event: np.ndarray,
    start: np.ndarray,
    texts: tuple[str, ...],
    event_names: tuple[str, ...],
    fractions: tuple[float, float, float],
) -> ForecastData:
    """Split time-ordered windows chronologically and scale every value by the mean and
    std of the train look-backs (so test statistics never leak into the scaling)."""
    parts = chronological_split(len(x), fractions)
    mean = float(x[parts[0]].mean())
    std = float(x[parts[0]].std())
    if not std > 0:
        raise InvalidValueError("series: the train windows are constant; cannot scale")
    whole = WindowSet(
        ((x - mean) / std).astype(np.float32),
        ((y - mean) / std).astype(np.float32),
        text_id.astype(np.int64),
        event.astype(np.int64),
        start.astype(np.int64),
    )
    train, val, test = (whole.subset(p) for p in parts)
    return ForecastData(train, val, test, texts, event_names, mean, std)


def windows_from_series(
    series: TextSeries,
    *,
    lookback: int,
    horizon: int,
    stride: int,
    fractions: tuple[float, float, float] = (0.7, 0.1, 0.2),
) -> ForecastData:
    """Windows of a user series: each window's text is the one at its forecast origin; its
    event type is ``"text"`` when that text is non-empty, else ``"none"``.

    Raises:
        InvalidValueError: the series is shorter than one window, or a split is empty.
    """
    starts = window_starts(len(series.values), lookback, horizon, stride)
    idx = starts[:, None] + np.arange(lookback + horizon)
    windows = series.values[idx]
    origin = [series.texts[s + lookback - 1] for s in starts]
    texts = tuple(dict.fromkeys(origin))
    lookup = {t: i for i, t in enumerate(texts)}
    text_id = np.array([lookup[t] for t in origin], dtype=np.int64)
    event = np.array([1 if t else 0 for t in origin], dtype=np.int64)
    return scale_windows(
        windows[:, :lookback],
        windows[:, lookback:],
        text_id,
        event,
        starts,
        texts,
        ("none", "text"),
        fractions,
    )
