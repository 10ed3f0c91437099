import json
import math
import subprocess
from pathlib import Path

import pytest

from moelab.errors import InvalidValueError
from moelab.utils import results
from moelab.utils.result_tables import paired_table, seeds_table, summary_table
from moelab.utils.results import (
    SCHEMA,
    ResultFileError,
    load_result,
    make_result,
    t_interval,
    write_result,
)

# Student t quantile 0.975 with 2 degrees of freedom, closed form for df = 2:
# t_p = (2p - 1) / sqrt(2 p (1 - p)) (tables: 4.303)
T_975_2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)


def _result(**kw):
    metrics = {
        "method": {0: {"acc": 3.0, "loss": 1.0}, 1: {"acc": 5.0, "loss": 1.5}, 2: {"acc": 7.0, "loss": 2.5}},
        "baseline": {0: {"acc": 2.0, "loss": 1.0}, 1: {"acc": 3.0, "loss": 1.0}, 2: {"acc": 4.0, "loss": 1.0}},
    }  # fmt: skip
    return make_result("toy", "method", {"lr": 0.1}, metrics, **kw)


def test_t_interval_by_hand():
    st = t_interval([1.0, 2.0, 3.0])
    assert st.n == 3 and st.mean == 2.0 and st.sd == 1.0
    half = T_975_2 * 1.0 / math.sqrt(3)
    assert st.ci == pytest.approx((2.0 - half, 2.0 + half), rel=1e-12)
    # 90% with df = 1 (Cauchy): t_{0.95, 1} = tan(0.45 pi); values [0, 2]: mean 1, sd sqrt(2)
    st = t_interval([0.0, 2.0], confidence=0.9)
    assert st.sd == pytest.approx(math.sqrt(2))
    assert st.ci[1] == pytest.approx(1 + math.tan(0.45 * math.pi), rel=1e-12)
    one = t_interval([4.0])
    assert (one.mean, one.sd, one.ci) == (4.0, None, None)


def test_summary_and_paired_by_hand():
    r = _result()
    s = r.summary()
    assert s["method"]["acc"].mean == 5.0 and s["method"]["acc"].sd == 2.0
    assert s["baseline"]["loss"].sd == 0.0 and s["baseline"]["loss"].ci == (1.0, 1.0)
    (acc, loss) = r.paired()
    assert (acc.arm, acc.baseline, acc.metric) == ("method", "baseline", "acc")
    assert acc.diffs == (1.0, 2.0, 3.0)  # method - baseline per seed
    half = T_975_2 / math.sqrt(3)
    assert acc.stats.mean == 2.0 and acc.stats.sd == 1.0
    assert acc.stats.ci == pytest.approx((2.0 - half, 2.0 + half), rel=1e-12)
    assert loss.diffs == (0.0, 0.5, 1.5)
    assert loss.stats.mean == pytest.approx(2 / 3)


def test_round_trip(tmp_path):
    r = _result(extra={"curve": [1, 2]})
    path = write_result(r, tmp_path / "sub" / "r.json")
    back = load_result(path)
    assert back == r
    obj = json.loads(path.read_text())
    assert obj["schema"] == SCHEMA and obj["seeds"] == [0, 1, 2]
    assert obj["metrics"]["method"]["1"] == {"acc": 5.0, "loss": 1.5}
    assert obj["paired"][0]["diffs"] == [1.0, 2.0, 3.0] and obj["paired"][0]["sd"] == 1.0
    assert obj["provenance"]["machine"]["python"].count(".") == 2
    assert not list(tmp_path.glob("sub/.*.tmp"))  # atomic write left no temp file


def test_git_commit_recorded_in_a_checkout(monkeypatch):
    top = Path(results.__file__).resolve().parents[3]
    if not (top / ".git").exists():
        pytest.skip("moelab is not imported from a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=top, capture_output=True, text=True)
    prov = _result().provenance
    assert prov.git_commit == head.stdout.strip() and isinstance(prov.git_dirty, bool)
    # an installed moelab inside some other repository reports no commit
    monkeypatch.setattr(results, "_git", lambda args, cwd: "/elsewhere\n")
    assert results.git_state() == (None, None)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_are_refused(bad):
    metrics = {"a": {0: {"acc": 1.0}, 1: {"acc": bad}}}
    with pytest.raises(InvalidValueError, match=r"field 'metrics\.a\.1\.acc': must be finite"):
        make_result("toy", "a", {}, metrics)


@pytest.mark.parametrize(
    ("metrics", "kw", "match"),
    [
        ({"a": {0: {"acc": 1.0}}, "b": {1: {"acc": 1.0}}}, {}, r"'metrics\.b': has seeds \[1\]"),
        ({"a": {0: {"acc": 1.0}, 1: {"loss": 1.0}}}, {}, r"'metrics\.a\.1': has metrics"),
        ({"a": {0: {"acc": True}}}, {}, r"'metrics\.a\.0\.acc': must be a number"),
        ({"a": {0: {"acc": 1.0}}}, {"pairs": [("a", "z")]}, r"'pairs\.0'"),
        ({"a": {0: {"acc": 1.0}}}, {"confidence": 1.0}, r"'confidence'"),
    ],
)
def test_bad_fields_are_named(metrics, kw, match):
    with pytest.raises(InvalidValueError, match=match):
        make_result("toy", "a", {}, metrics, **kw)


def test_config_must_be_plain_json():
    with pytest.raises(InvalidValueError, match=r"'config': is not plain JSON"):
        make_result("toy", "a", {"x": object()}, {"a": {0: {"acc": 1.0}}})


def _corrupt(tmp_path, edit):
    path = write_result(_result(), tmp_path / "r.json")
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda o: o.update(schema="moelab.result/2"), "schema"),
        (lambda o: o.pop("seeds"), "seeds"),
        (lambda o: o["metrics"]["method"]["1"].update(acc="x"), "metrics.method.1.acc"),
        (lambda o: o["metrics"]["method"].update({"01": o["metrics"]["method"].pop("1")}), "metrics.method"),
        (lambda o: o["provenance"].update(git_dirty="no"), "provenance.git_dirty"),
        (lambda o: o["metrics"]["method"]["0"].update(acc=4.0), "summary"),  # stale derived part
        (lambda o: o["paired"][0].update(mean=9.0), "paired"),
    ],
)  # fmt: skip
def test_corrupted_file_names_file_and_field(tmp_path, edit, field):
    path = _corrupt(tmp_path, edit)
    with pytest.raises(ResultFileError) as info:
        load_result(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: field {field!r}:") and "\n" not in msg


def test_truncated_or_missing_file(tmp_path):
    path = write_result(_result(), tmp_path / "r.json")
    path.write_text(path.read_text()[:100])
    with pytest.raises(ResultFileError, match=rf"^{path}: not a valid JSON result file"):
        load_result(path)
    with pytest.raises(ResultFileError, match="result file not found"):
        load_result(tmp_path / "nope.json")


def test_tables(tmp_path):
    # half-widths h = t_{0.975,2} * sd / sqrt(3) with t = 4.303: acc of "method" (sd 2)
    # h = 4.969, of "baseline" (sd 1) h = 2.484; loss of "method" (mean 5/3, sd 0.764)
    # h = 1.897; the paired acc differences [1, 2, 3] (sd 1) h = 2.484.
    path = write_result(_result(), tmp_path / "r.json")
    single = make_result("one|seed", "a", {}, {"a": {7: {"acc": 0.5}}})
    table = summary_table([path, single], metrics=["acc", "loss"], fmt=".1f")
    assert table.splitlines() == [
        "| result | arm | seeds | acc (mean ± sd) | acc 95 % interval "
        "| loss (mean ± sd) | loss 95 % interval |",
        "|---|---|---:|---:|---:|---:|---:|",
        "| toy | method | 3 | 5.0 ± 2.0 | [0.0, 10.0] | 1.7 ± 0.8 | [−0.2, 3.6] |",
        "| toy | baseline | 3 | 3.0 ± 1.0 | [0.5, 5.5] | 1.0 ± 0.0 | [1.0, 1.0] |",
        "| one\\|seed | a | 1 | 0.5 |  |  |  |",
    ]
    rows = paired_table([path], metrics=["acc"], fmt=".2f").splitlines()
    assert rows[0] == "| result | arm − baseline | metric | per seed | mean ± sd | 95 % interval |"
    assert rows[2:] == [
        "| toy | method − baseline | acc | +1.00, +2.00, +3.00 | **+2.00** ± 1.00 | [−0.48, 4.48] |"
    ]
    assert seeds_table(path, fmt=".1f").splitlines() == [
        "| arm | seed | acc | loss |",
        "|---|---:|---:|---:|",
        "| method | 0 | 3.0 | 1.0 |",
        "| method | 1 | 5.0 | 1.5 |",
        "| method | 2 | 7.0 | 2.5 |",
        "| baseline | 0 | 2.0 | 1.0 |",
        "| baseline | 1 | 3.0 | 1.0 |",
        "| baseline | 2 | 4.0 | 1.0 |",
    ]


def test_tables_refuse_mixed_confidence_levels(tmp_path):
    # the interval column names one level, so results of another one cannot share it
    with pytest.raises(InvalidValueError, match=r"one confidence, got confidences \[0\.9, 0\.95\]"):
        summary_table([_result(), _result(confidence=0.9)])
    with pytest.raises(InvalidValueError, match="got no result"):
        paired_table([])


def test_bootstrap_interval_brackets_the_mean_and_is_degenerate_for_constants():
    from moelab.utils.results import bootstrap_interval

    assert bootstrap_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)
    # paired 0/1 differences: mean 0.25; the interval holds it and stays inside [0, 1]
    lo, hi = bootstrap_interval([1, 0, 0, 0] * 25, resamples=2000)
    assert 0.0 <= lo < 0.25 < hi <= 1.0
    # about ±1.96 standard errors: sd of the mean = sqrt(0.25·0.75/100) ≈ 0.0433
    assert hi - lo == pytest.approx(2 * 1.96 * 0.0433, rel=0.15)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_interval([])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval([1.0], confidence=1.0)


def test_bootstrap_interval_of_paired_differences():
    import numpy as np

    from moelab.utils.results import bootstrap_interval

    # one value: every resample is that value
    assert bootstrap_interval([0.25]) == (0.25, 0.25)
    # two values a, b: resample means are a (1/4), (a+b)/2 (1/2), b (1/4); 90 % -> [a, b]
    assert bootstrap_interval([0.0, 1.0], confidence=0.9, resamples=20_000) == (0.0, 1.0)
    lo, hi = bootstrap_interval([1.0, 2.0, 3.0], seed=3)
    # a slow reference: every one of the 27 resamples, its mean, weighted equally
    grid = np.array([[a, b, c] for a in (1, 2, 3) for b in (1, 2, 3) for c in (1, 2, 3)])
    exact = np.quantile(grid.mean(1), [0.025, 0.975])
    assert lo == pytest.approx(exact[0], abs=0.34) and hi == pytest.approx(exact[1], abs=0.34)
    assert 1.0 <= lo < 2.0 < hi <= 3.0
    assert bootstrap_interval([1.0, 2.0, 3.0], seed=3) == (lo, hi)  # reproducible
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval([1.0], resamples=0)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_interval([float("nan")])
