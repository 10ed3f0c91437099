import importlib.util

import numpy as np
import pytest

from moelab.data.errors import CorpusError
from moelab.data.timeseries import (
    chronological_split,
    load_series_csv,
    load_taylor,
    parse_taylor_source,
    window_starts,
    windows_from_series,
)
from moelab.errors import InvalidValueError


def test_parse_taylor_source_reads_the_array_literal():
    values = ", ".join(str(i) for i in range(4032))
    src = f"import numpy as np\n\ndef load():\n    x = np.array([\n        {values}]).astype(t)\n"
    out = parse_taylor_source(src)
    assert out.shape == (4032,) and out.dtype == np.float64
    assert out[0] == 0 and out[4031] == 4031


def test_parse_taylor_source_refuses_wrong_text():
    with pytest.raises(CorpusError, match=r"no np\.array"):
        parse_taylor_source("nothing here")
    with pytest.raises(CorpusError, match="expected 4032 values, found 3"):
        parse_taylor_source("np.array([1, 2, 3])")


@pytest.mark.skipif(importlib.util.find_spec("pmdarima") is None, reason="pmdarima missing")
def test_load_taylor_gives_the_real_series():
    x = load_taylor()
    assert x.shape == (4032,)
    # pmdarima's own docstring example: load_taylor()[:10]
    first = [22262, 21756, 22247, 22759, 22549, 22313, 22128, 21860, 21751, 21336]
    assert x[:10].tolist() == first
    assert x[-1] == 23132


def test_window_starts_and_errors():
    assert window_starts(10, 4, 2, 2).tolist() == [0, 2, 4]
    assert window_starts(6, 4, 2, 3).tolist() == [0]
    with pytest.raises(InvalidValueError, match="shorter than one window"):
        window_starts(5, 4, 2, 1)
    with pytest.raises(InvalidValueError, match="stride"):
        window_starts(10, 4, 2, 0)


def test_chronological_split():
    train, val, test = chronological_split(10, (0.7, 0.1, 0.2))
    assert (train, val, test) == (slice(0, 7), slice(7, 8), slice(8, 10))
    with pytest.raises(InvalidValueError, match="summing to 1"):
        chronological_split(10, (0.5, 0.1, 0.1))
    with pytest.raises(InvalidValueError, match="empty split"):
        chronological_split(3, (0.8, 0.1, 0.1))


def _csv(tmp_path, rows, header="timestamp,value,text"):
    p = tmp_path / "s.csv"
    p.write_text(header + "\n" + "\n".join(rows) + "\n")
    return p


def test_series_csv_windows_take_the_text_at_the_origin(tmp_path):
    rows = [f"t{i},{float(i)},{'note' if i == 5 else ''}" for i in range(20)]
    s = load_series_csv(_csv(tmp_path, rows))
    assert s.values[3] == 3.0 and s.texts[5] == "note" and s.texts[4] == ""
    data = windows_from_series(s, lookback=4, horizon=2, stride=1, fractions=(0.6, 0.2, 0.2))
    # 15 windows: 9 train, 3 val, 3 test; window w's origin is step w + 3
    assert (len(data.train), len(data.val), len(data.test)) == (9, 3, 3)
    assert data.texts[data.train.text_id[2]] == "note"
    assert data.train.event.tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    train_x = np.array([[w + j for j in range(4)] for w in range(9)], dtype=float)
    mean, std = train_x.mean(), train_x.std()
    assert data.mean == pytest.approx(mean) and data.std == pytest.approx(std)
    np.testing.assert_allclose(data.test.y[0], (np.array([16.0, 17.0]) - mean) / std, rtol=1e-6)


def test_series_csv_errors(tmp_path):
    with pytest.raises(CorpusError, match="missing column 'text'"):
        load_series_csv(_csv(tmp_path, ["a,1"], header="timestamp,value"))
    with pytest.raises(CorpusError, match=r"s.csv:3: value 'x'"):
        load_series_csv(_csv(tmp_path, ["a,1,", "b,x,"]))
    with pytest.raises(CorpusError, match="cannot read"):
        load_series_csv(tmp_path / "missing.csv")
