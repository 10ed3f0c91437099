"""``moelab rl train``: a tiny run writes the shared result and the curves; bad options exit 2."""

import pytest
from typer.testing import CliRunner

from moelab.cli import app
from moelab.utils.results import load_result

pytest.importorskip("minigrid")

runner = CliRunner()
TINY = ["--frames", "100", "--eval-every", "100", "--eval-episodes", "1", "--final-episodes", "1", "--max-steps", "15",
        "--no-progress"]  # fmt: skip


def test_rl_train_writes_result_and_plot(tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(
        app, ["rl", "train", "--arm", "pamoe", "--arm", "single", "--seed", "3",
              "--out", str(out), *TINY],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    result = load_result(out)
    assert result.arms == ("pamoe", "single") and result.seeds == (3,)
    assert result.metrics["single"][3]["switches"] == 0.0  # one expert never switches
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arm", "token"], "--arm"),
        (["--arm", "single", "--arm", "single"], "each arm once"),
        (["--estimator", "ppo"], "estimator"),
        (["--task-weight", "1"], "--task"),
        (["--frames", "0"], "frames"),
    ],
)
def test_rl_train_bad_options_exit_2(tmp_path, args, message):
    res = runner.invoke(app, ["rl", "train", "--out", str(tmp_path / "r.json"), *args])
    assert res.exit_code == 2
    assert message in res.output
