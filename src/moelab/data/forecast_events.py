"""Announced events injected into windows of a real half-hourly series, with templated notices.

This is **synthetic**: the series is real (``taylor``), the events and their announcements
are not. It is this project's test bed for text-guided forecasting (TiMi; no real series with
aligned future-event text installs offline, ``shared/research/wave3-science.md`` §2.3).

Each window is drawn on its own, from a generator seeded by ``(seed, window start)``, and the
event changes only that window's copy of its horizon: the look-back stays the real series,
and overlapping windows never see each other's events (counterfactual injection, so nothing
leaks across windows or splits). With probability ``probability`` a window gets one of three
events, else none:

* ``surge``: the affected steps × 1.12;
* ``drop``: × 0.88;
* ``holiday``: the affected steps follow the same clock times one week earlier × 0.85
  (with a look-back of a week or more, those values lie in the look-back).

Variants: ``"whole"`` (the event covers the whole horizon: a regime, the primary claim's
setting) and ``"partial"`` (the notes' design: onset ``o`` inside the horizon, a multiple of
2 hours, lasting 3, 6, 9 or 12 hours and ending inside it). Every window also gets a notice
(three paraphrases per type; "no event" windows get a "nothing unusual" notice, which is
information too). Whole-horizon notices say how long before the forecast they were issued
(2, 6 or 12 hours: the announcement lies inside the look-back); partial-horizon notices say
when the event starts and ends, in hours after the forecast origin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moelab.data.timeseries import ForecastData, scale_windows, window_starts
from moelab.errors import InvalidValueError

Variant = Literal["whole", "partial"]
VARIANTS: tuple[Variant, ...] = ("whole", "partial")
EVENT_NAMES = ("none", "surge", "drop", "holiday")
SURGE, DROP, HOLIDAY = 1.12, 0.88, 0.85
STEPS_PER_HOUR = 2
WEEK = 7 * 24 * STEPS_PER_HOUR
LEAD_HOURS = (2, 6, 12)
PARTIAL_LENGTHS = (6, 12, 18, 24)  # steps
ONSET_EVERY = 4  # steps (2 hours)

_PREFIX = ("Grid notice", "Operator bulletin", "Advance warning")
_BODY = {
    "none": (
        "no unusual demand is expected {when}.",
        "normal conditions, no announcements {when}.",
        "nothing to report {when}.",
    ),
    "surge": (
        "demand is expected to run about 12% above normal {when}.",
        "a heat wave will lift electricity demand by roughly 12 percent {when}.",
        "expect elevated load, some 12% higher than usual, {when}.",
    ),
    "drop": (
        "demand is expected to run about 12% below normal {when}.",
        "a large industrial shutdown will cut electricity demand by roughly 12 percent {when}.",
        "expect reduced load, some 12% lower than usual, {when}.",
    ),
    "holiday": (
        "public holiday {when}; demand expected to follow a Sunday pattern.",
        "bank holiday {when}, so consumption should resemble last week's profile, about 15% lower.",
        "national holiday {when}; expect a weekend-like load curve.",
    ),
}
PARAPHRASES = len(_PREFIX)


@dataclass(frozen=True)
class Event:
    """One window's event.

    Attributes:
        kind: index in :data:`EVENT_NAMES` (0 = none).
        onset: first affected horizon step.
        length: affected steps (``onset + length <= horizon``).
        paraphrase: which of the :data:`PARAPHRASES` notices announces it.
        lead_hours: how long before the forecast origin the notice was issued (whole-horizon
            variant), or None.
    """

    kind: int
    onset: int
    length: int
    paraphrase: int
    lead_hours: int | None


def partial_spans(horizon: int) -> list[tuple[int, int]]:
    """Every ``(onset, length)`` of the partial-horizon variant inside ``horizon`` steps."""
    return [(o, n) for n in PARTIAL_LENGTHS for o in range(0, horizon - n + 1, ONSET_EVERY)]


def draw_event(
    rng: np.random.Generator, variant: Variant, horizon: int, probability: float
) -> Event:
    """One window's event (see the module docstring), drawn from ``rng``."""
    kind = int(1 + rng.integers(3)) if rng.random() < probability else 0
    paraphrase = int(rng.integers(PARAPHRASES))
    if variant == "whole" or kind == 0:
        lead = int(LEAD_HOURS[rng.integers(len(LEAD_HOURS))]) if variant == "whole" else None
        return Event(kind, 0, horizon, paraphrase, lead)
    spans = partial_spans(horizon)
    onset, length = spans[int(rng.integers(len(spans)))]
    return Event(kind, onset, length, paraphrase, None)


def apply_event(x: np.ndarray, y: np.ndarray, event: Event) -> np.ndarray:
    """A copy of horizon ``y [H]`` with ``event`` injected (look-back ``x [L]`` supplies the
    holiday's values a week earlier: step ``h`` takes ``0.85 · x[L − WEEK + h]``).

    Raises:
        InvalidValueError: a holiday with a look-back shorter than a week.
    """
    out = np.array(y, dtype=np.float64, copy=True)
    span = slice(event.onset, event.onset + event.length)
    name = EVENT_NAMES[event.kind]
    if name == "surge":
        out[span] *= SURGE
    elif name == "drop":
        out[span] *= DROP
    elif name == "holiday":
        L = x.shape[0]
        if L < WEEK:
            raise InvalidValueError(f"lookback: a holiday needs >= {WEEK} steps, got {L}")
        h = np.arange(event.onset, event.onset + event.length)
        out[span] = HOLIDAY * x[L - WEEK + h]
    return out


def notice(event: Event, horizon: int) -> str:
    """The announcement of ``event`` (see the module docstring for its wording)."""
    hours = horizon // STEPS_PER_HOUR
    if event.kind == 0 or event.length == horizon:
        when = f"over the next {hours} hours"
    else:
        a = event.onset // STEPS_PER_HOUR
        b = (event.onset + event.length) // STEPS_PER_HOUR
        when = f"from {a} to {b} hours after the forecast time"
    prefix = _PREFIX[event.paraphrase]
    if event.lead_hours is not None:
        prefix += f" issued {event.lead_hours} hours before the forecast"
    body = _BODY[EVENT_NAMES[event.kind]][event.paraphrase].format(when=when)
    return f"{prefix}: {body}"


def make_event_windows(
    values: np.ndarray,
    *,
    variant: Variant,
    seed: int,
    lookback: int = WEEK,
    horizon: int = 48,
    stride: int = 4,
    probability: float = 0.35,
    fractions: tuple[float, float, float] = (0.7, 0.1, 0.2),
) -> ForecastData:
    """Windows of ``values [n]`` with events injected and announced, split chronologically
    and scaled by the train look-backs (:func:`moelab.data.timeseries.scale_windows`).

    Deterministic in ``(seed, window start)``: the same seed gives the same events.

    Raises:
        InvalidValueError: an unknown variant, ``probability`` outside [0, 1], a look-back
            shorter than a week, or sizes as in :func:`window_starts`.
    """
    if variant not in VARIANTS:
        raise InvalidValueError(f"variant: must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if not 0.0 <= probability <= 1.0:
        raise InvalidValueError(f"probability: must be in [0, 1], got {probability}")
    if lookback < WEEK:
        raise InvalidValueError(f"lookback: must be >= {WEEK} (a week, for holidays)")
    values = np.asarray(values, dtype=np.float64)
    starts = window_starts(values.shape[0], lookback, horizon, stride)
    x = np.stack([values[s : s + lookback] for s in starts])
    y = np.empty((len(starts), horizon))
    kinds = np.empty(len(starts), dtype=np.int64)
    strings: list[str] = []
    for i, s in enumerate(starts):
        rng = np.random.default_rng([seed, int(s)])
        event = draw_event(rng, variant, horizon, probability)
        y[i] = apply_event(x[i], values[s + lookback : s + lookback + horizon], event)
        kinds[i] = event.kind
        strings.append(notice(event, horizon))
    texts = tuple(dict.fromkeys(strings))
    lookup = {t: j for j, t in enumerate(texts)}
    text_id = np.array([lookup[t] for t in strings], dtype=np.int64)
    return scale_windows(x, y, text_id, kinds, starts, texts, EVENT_NAMES, fractions)


def all_notices(horizon: int = 48) -> list[str]:
    """Every notice either variant can produce (to encode them all once, ahead of training)."""
    events = [
        Event(k, 0, horizon, p, lead) for k in range(4) for p in range(3) for lead in LEAD_HOURS
    ]
    events += [Event(0, 0, horizon, p, None) for p in range(3)]
    events += [
        Event(k, o, n, p, None)
        for k in range(1, 4)
        for p in range(3)
        for o, n in partial_spans(horizon)
    ]
    return [notice(e, horizon) for e in events]
