"""``moelab align run``: bad options exit 2 with a one-line message naming the option."""

import pytest
from typer.testing import CliRunner

from moelab.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arm", "router_only"], "--arm"),
        (["--epsilon", "0"], "epsilon"),
        (["--rho", "-1"], "rho"),
        (["--w", "9"], "w"),
        (["--from", "no/such/folder"], "source"),
    ],
)
def test_align_run_bad_options_exit_2(tmp_path, args, message):
    res = runner.invoke(app, ["align", "run", "--out", str(tmp_path / "m"), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
