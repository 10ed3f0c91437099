"""docs/render_results.py and the docs' result files: the files load with the library's checks,
and the pages' tables and plots show their numbers and conditions."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

from moelab.utils.results import load_result

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load("render_results", ROOT / "docs" / "render_results.py")

# t_{0.975, 2}: the two-sided 95 % Student-t quantile for 3 seeds (statistical tables).
T_975_2 = 4.302652729911275


def test_every_result_file_passes_the_library_checks():
    # load_result checks the schema and that the stored summaries and paired differences
    # are those of the per-seed metrics.
    files = sorted(RESULTS.glob("*.json"))
    assert {"moe_vs_dense_bpe512_380s.json", "molf.json"} <= {p.name for p in files}
    for path in files:
        r = load_result(path)
        assert len(r.seeds) == 3 and r.pairs, path.name


def test_summary_and_paired_statistics_match_a_hand_computation():
    r = load_result(RESULTS / "moe_vs_dense_bpe512_190s.json")
    moe = [2.3629, 2.3253, 2.4847]  # the per-seed values as measured
    twin = [2.4120, 2.4190, 2.5367]
    assert [r.metrics["moe"][s]["val_bpb"] for s in (0, 1, 2)] == moe
    st = r.summary()["moe"]["val_bpb"]
    assert st.n == 3
    assert math.isclose(st.mean, statistics.fmean(moe), rel_tol=1e-12)
    assert math.isclose(st.sd, statistics.stdev(moe), rel_tol=1e-12)
    half = T_975_2 * statistics.stdev(moe) / math.sqrt(3)
    assert st.ci[0] == pytest.approx(statistics.fmean(moe) - half, rel=1e-9)
    (p,) = r.paired()
    diffs = [t - m for t, m in zip(twin, moe, strict=True)]
    assert (p.arm, p.baseline) == ("dense_twin", "moe")
    assert p.diffs == pytest.approx(diffs)
    assert p.stats.mean == pytest.approx(0.0649, abs=5e-5)  # MoE ahead by 0.0649 on average
    dhalf = T_975_2 * statistics.stdev(diffs) / math.sqrt(3)
    assert p.stats.ci == pytest.approx(
        (statistics.fmean(diffs) - dhalf, statistics.fmean(diffs) + dhalf)
    )


def test_tables_show_the_numbers_and_the_conditions_once():
    r = load_result(RESULTS / "moe_vs_dense_bpe512_190s.json")
    seeds = render.seeds_table(r)
    assert "| moe | 0 | 2.3629 |" in seeds and "| dense_twin | 2 | 2.5367 |" in seeds
    assert seeds.count("*Conditions —") == 1 and "`0a90865`" in seeds
    paired = render.paired_table([r])
    assert "+0.0491, +0.0937, +0.0520" in paired
    assert "**+0.0649** ± 0.0250" in paired
    summary = render.summary_table([r])
    assert "| moe_vs_dense_bpe512_190s | moe | 3 | 2.3910 ± 0.0833 |" in summary


def test_conditions_shared_by_several_results_are_stated_once():
    rs = [load_result(RESULTS / f"moe_vs_dense_bpe512_{b}s.json") for b in (190, 380, 760)]
    line = render.conditions(rs)
    assert line.count("machine:") == 1  # the same machine for the three
    assert line.count("command: `") == 3  # one command per budget
    assert "`0a90865`" in line and "`56155a2`" in line


def test_a_bad_result_file_fails_the_build(tmp_path, monkeypatch):
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hook = _load("moelab_docs_hook_results", ROOT / "docs" / "hooks" / "results.py")
    obj = json.loads((RESULTS / "moe_vs_dense_bytes_330s.json").read_text())
    obj["paired"][0]["mean"] += 0.01  # a hand-edited summary no longer matches the seeds
    (tmp_path / "edited.json").write_text(json.dumps(obj))
    monkeypatch.setattr(hook, "RESULTS", tmp_path)
    with pytest.raises(PluginError, match=r"^p\.md: .*edited\.json: field 'paired': does not"):
        hook.load(["edited"], "p.md")


def test_plot_is_a_png_over_the_config_key():
    pytest.importorskip("matplotlib")
    rs = [load_result(RESULTS / f"moe_vs_dense_bpe512_{b}s.json") for b in (760, 190, 380)]
    png = render.plot_png(rs, "val_bpb", x="budget_s")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
