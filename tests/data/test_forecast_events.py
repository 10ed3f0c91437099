import numpy as np
import pytest

from moelab.data.forecast_events import (
    WEEK,
    Event,
    apply_event,
    make_event_windows,
    notice,
    partial_spans,
)
from moelab.errors import InvalidValueError


def test_apply_event_by_hand():
    x = np.arange(WEEK, dtype=float)
    y = np.full(48, 100.0)
    np.testing.assert_allclose(apply_event(x, y, Event(1, 0, 48, 0, 2)), 112.0)
    np.testing.assert_allclose(apply_event(x, y, Event(2, 0, 48, 0, 2)), 88.0)
    part = apply_event(x, y, Event(1, 4, 6, 0, None))
    assert part[:4].tolist() == [100.0] * 4 and part[10:].tolist() == [100.0] * 38
    np.testing.assert_allclose(part[4:10], 112.0)
    # holiday: horizon step h takes 0.85 × the value a week earlier, x[L - WEEK + h] = h
    hol = apply_event(x, y, Event(3, 8, 6, 0, None))
    np.testing.assert_allclose(hol[8:14], 0.85 * np.arange(8, 14))
    assert hol[:8].tolist() == [100.0] * 8
    assert apply_event(x, y, Event(0, 0, 48, 0, 2)).tolist() == y.tolist()
    assert y.tolist() == [100.0] * 48  # the input is not modified
    with pytest.raises(InvalidValueError, match="a holiday needs"):
        apply_event(x[:10], y, Event(3, 0, 48, 0, None))


def test_notices_by_hand():
    assert notice(Event(1, 0, 48, 0, 6), 48) == (
        "Grid notice issued 6 hours before the forecast: demand is expected to run about "
        "12% above normal over the next 24 hours."
    )
    assert notice(Event(3, 8, 12, 2, None), 48) == (
        "Advance warning: national holiday from 4 to 10 hours after the forecast time; "
        "expect a weekend-like load curve."
    )


def test_partial_spans_stay_inside_the_horizon():
    spans = partial_spans(48)
    assert len(spans) == 11 + 10 + 8 + 7
    assert all(o % 4 == 0 and o + n <= 48 and 6 <= n <= 24 for o, n in spans)


def _series(n=WEEK + 48 + 4 * 30):
    t = np.arange(n)
    return 1000 + 100 * np.sin(2 * np.pi * t / 48) + t


@pytest.mark.parametrize("variant", ["whole", "partial"])
def test_injection_is_per_window_and_deterministic(variant):
    v = _series()
    a = make_event_windows(v, variant=variant, seed=3, probability=0.5)
    b = make_event_windows(v, variant=variant, seed=3, probability=0.5)
    c = make_event_windows(v, variant=variant, seed=4, probability=0.5)
    for part in ("train", "val", "test"):
        assert np.array_equal(getattr(a, part).y, getattr(b, part).y)
        assert np.array_equal(getattr(a, part).event, getattr(b, part).event)
    events = np.concatenate([a.train.event, a.val.event, a.test.event])
    other = np.concatenate([c.train.event, c.val.event, c.test.event])
    assert not np.array_equal(events, other)
    assert 0 < (events > 0).mean() < 1
    for part in (a.train, a.val, a.test):
        real = np.stack([v[s : s + WEEK + 48] for s in part.start])
        x = part.x * a.std + a.mean
        y = part.y * a.std + a.mean
        # look-backs are always the real series, even where an earlier window had an event
        np.testing.assert_allclose(x, real[:, :WEEK], rtol=1e-5)
        free = part.event == 0
        np.testing.assert_allclose(y[free], real[free, WEEK:], rtol=1e-5)
        surge = part.event == 1
        changed = ~np.isclose(y[surge], real[surge, WEEK:], rtol=1e-5)
        assert changed.any(axis=1).all()
        if variant == "whole":
            np.testing.assert_allclose(y[surge], 1.12 * real[surge, WEEK:], rtol=1e-5)
        else:  # one contiguous run of 6..24 changed steps
            assert ((changed.sum(1) >= 6) & (changed.sum(1) <= 24)).all()


def test_event_windows_errors():
    with pytest.raises(InvalidValueError, match="variant"):
        make_event_windows(_series(), variant="half", seed=0)
    with pytest.raises(InvalidValueError, match="probability"):
        make_event_windows(_series(), variant="whole", seed=0, probability=1.5)
    with pytest.raises(InvalidValueError, match="lookback"):
        make_event_windows(_series(), variant="whole", seed=0, lookback=48)
