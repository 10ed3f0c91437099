import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data.forecast_events import WEEK
from moelab.methods.forecasting import ForecastConfig, TextCache, TiMiRecipe
from moelab.methods.forecasting.run import load_data, text_vectors
from moelab.methods.runner import run_seeds

TINY = dict(d_model=8, n_heads=2, n_layers=1, epochs=2, batch_size=16)


def _series(n=WEEK + 48 + 4 * 40):
    t = np.arange(n)
    return 1000 + 100 * np.sin(2 * np.pi * t / 48) + 0.5 * t


def _fake_encoder(texts):
    return torch.tensor(
        [[float(len(t)), float(t.count("e")), float("holiday" in t)] for t in texts]
    )


def test_recipe_runs_paired_arms_with_usage():
    cache = TextCache("fake", encode=_fake_encoder)
    recipe = TiMiRecipe(cache, series=_series())
    result = run_seeds(
        recipe,
        ForecastConfig(**TINY, event_probability=0.5),
        [0],
        arms={"mmoe": {"arm": "mmoe"}, "unimodal": {"arm": "unimodal"}},
    )
    m = result.metrics["mmoe"][0]
    assert {"mse", "mse_event", "mse_free", "mae_event", "mae_free"} <= set(m)
    for key in ("b0/tmoe", "b0/smoe"):
        for t in ("none", "surge", "drop", "holiday"):
            row = [m[f"usage/{key}/{t}/e{e}"] for e in range(4)]
            assert sum(row) == pytest.approx(2.0) or sum(row) == 0.0  # k = 2 per window
    assert 0 < m["purity_chance"] <= m["purity/b0/tmoe"] <= 1
    assert not any(k.startswith("usage") for k in result.metrics["unimodal"][0])
    assert cache.calls == len(recipe.data(ForecastConfig(**TINY, event_probability=0.5), 0).texts)


def test_text_vectors_are_zscored_on_train_windows():
    data = load_data(ForecastConfig(), 0, _series())
    z = text_vectors(data, TextCache("fake", encode=_fake_encoder))
    train = z[torch.from_numpy(data.train.text_id)]
    torch.testing.assert_close(train.mean(0), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(train.std(0, unbiased=False), torch.ones(3), atol=1e-5, rtol=0)


def test_cli_trains_on_a_user_csv(tmp_path):
    csv = tmp_path / "demand.csv"
    values = _series(300)
    rows = [f"{i},{values[i]:.3f},{'maintenance' if i % 50 == 0 else ''}" for i in range(300)]
    csv.write_text("timestamp,value,text\n" + "\n".join(rows) + "\n")
    out = tmp_path / "r.json"
    args = ["forecast", "train", "--data", str(csv), "--arms", "smoe,unimodal", "--lookback"]
    args += ["64", "--horizon", "8", "--epochs", "1", "--out", str(out), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    saved = json.loads(out.read_text())
    assert saved["arms"] == ["smoe", "unimodal"] and saved["pairs"] == [["smoe", "unimodal"]]
    res = CliRunner().invoke(app, ["forecast", "train", "--arms", "mmoe,late", "--out", str(out)])
    assert res.exit_code == 2 and "--arms" in res.output
    res = CliRunner().invoke(app, ["forecast", "train", "--seeds", "a", "--out", str(out)])
    assert res.exit_code == 2 and "--seeds" in res.output
