"""run_seeds on a toy recipe whose metrics are known in closed form."""

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.methods.runner import run_seeds
from moelab.utils.results import load_result

T_975_2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t quantile, df = 2: (2p-1)/sqrt(2p(1-p))


@dataclasses.dataclass(frozen=True)
class LineConfig:
    intercept: bool = True
    n_points: int = 4

    def __post_init__(self):
        if self.n_points < 2:
            raise InvalidValueError(f"n_points must be >= 2, got {self.n_points}")


class LineFit:
    """Least-squares fit of y = 2x + seed on x = 0..n-1, with or without an intercept."""

    name = "linefit"

    def __init__(self):
        self.rng_draws = []

    def run(self, config, seed):
        self.rng_draws.append((random.random(), float(np.random.rand()), torch.rand(()).item()))
        x = np.arange(config.n_points, dtype=float)
        y = 2 * x + seed
        cols = [x, np.ones_like(x)] if config.intercept else [x]
        coef, *_ = np.linalg.lstsq(np.stack(cols, axis=1), y, rcond=None)
        return {"slope": float(coef[0]), "mse": float(np.mean((np.stack(cols, 1) @ coef - y) ** 2))}


def test_two_arms_paired_differences_by_hand(tmp_path):
    recipe = LineFit()
    out = tmp_path / "line.json"
    result = run_seeds(
        recipe,
        LineConfig(),
        [1, 2, 3],
        arms={"origin": {"intercept": False}, "full": {}},
        name="toy_line",
        out=out,
    )
    # Through the origin on x = 0..3: slope = sum(x y) / sum(x^2) = 2 + s * 6/14 = 2 + 3s/7,
    # residuals s (1 - 3x/7) so mse = s^2 * (1 + 16/49 + 1/49 + 4/49) / 4 = 5 s^2 / 14.
    # With an intercept the fit is exact: slope 2, mse 0.
    obj = json.loads(out.read_text())
    assert obj["name"] == "toy_line" and obj["method"] == "linefit"
    assert obj["seeds"] == [1, 2, 3] and obj["arms"] == ["origin", "full"]
    assert obj["pairs"] == [["origin", "full"]]
    assert obj["config"] == {
        "recipe": "linefit",
        "base": {"intercept": True, "n_points": 4},
        "arms": {"origin": {"intercept": False}, "full": {}},
    }
    for s in (1, 2, 3):
        assert obj["metrics"]["origin"][str(s)]["slope"] == pytest.approx(2 + 3 * s / 7)
        assert obj["metrics"]["full"][str(s)]["slope"] == pytest.approx(2.0)
    slope, mse = obj["paired"]
    assert (slope["arm"], slope["baseline"], slope["metric"]) == ("origin", "full", "slope")
    assert slope["diffs"] == pytest.approx([3 / 7, 6 / 7, 9 / 7])
    assert slope["mean"] == pytest.approx(6 / 7) and slope["sd"] == pytest.approx(3 / 7)
    half = T_975_2 * (3 / 7) / math.sqrt(3)
    assert slope["ci"] == pytest.approx([6 / 7 - half, 6 / 7 + half])
    # mse diffs [5, 20, 45] / 14: mean 70/42 = 5/3; deviations [15 - 70, 60 - 70, 135 - 70] / 42,
    # sum of squares (3025 + 100 + 4225) / 1764 = 7350/1764, sd = sqrt(that / 2)
    assert mse["mean"] == pytest.approx(5 / 3)
    assert mse["sd"] == pytest.approx(math.sqrt(7350 / 1764 / 2))
    assert obj["summary"]["full"]["mse"]["mean"] == pytest.approx(0.0, abs=1e-20)
    assert set(obj["extra"]["run_seconds"]["full"]) == {"1", "2", "3"}
    assert load_result(out) == result


def test_each_run_gets_the_seeded_rng_state():
    recipe = LineFit()
    run_seeds(recipe, LineConfig(), [5, 6], arms={"a": {}, "b": {"intercept": False}})
    a5, b5, a6, b6 = recipe.rng_draws  # seed-major: seed 5 (a, b), seed 6 (a, b)
    assert a5 == b5 and a6 == b6 and a5 != a6
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    assert a5 == (random.random(), float(np.random.rand()), torch.rand(()).item())


def test_single_arm_is_named_after_the_recipe():
    result = run_seeds(LineFit(), LineConfig(n_points=3), [0])
    assert result.arms == ("linefit",) and result.pairs == ()
    assert result.summary()["linefit"]["slope"].sd is None  # one seed: no spread


@dataclasses.dataclass(frozen=True)
class NaNConfig:
    intercept: bool = True
    n_points: int = 4
    tol: float = math.nan


class NaNRecipe:
    name = "nan"

    def run(self, config, seed):
        return {"loss": math.nan if seed == 1 else 1.0}


@pytest.mark.parametrize(
    ("recipe", "config", "seeds", "arms", "error", "match"),
    [
        (NaNRecipe(), LineConfig(), [0, 1], None, InvalidValueError, r"'metrics\.nan\.1\.loss': must be finite"),
        (LineFit(), LineConfig(), [0, 0], None, InvalidValueError, "seeds must be distinct"),
        (LineFit(), LineConfig(), [], None, InvalidValueError, "non-empty"),
        (LineFit(), LineConfig(), [0], {"a": {"lr": 1.0}}, InvalidValueError, "arm 'a': LineConfig has no field 'lr'"),
        (LineFit(), LineConfig(), [0], {"a": {"n_points": 1}}, InvalidValueError, "n_points must be >= 2"),
        (LineFit(), {"intercept": True}, [0], None, InvalidTypeError, "must be a dataclass instance"),
        (LineFit(), NaNConfig(), [0], None, InvalidValueError, "config holds Out of range float"),
    ],
)  # fmt: skip
def test_bad_inputs(recipe, config, seeds, arms, error, match):
    with pytest.raises(error, match=match):
        run_seeds(recipe, config, seeds, arms=arms)
