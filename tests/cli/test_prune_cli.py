"""``moelab prune``: the pruned folder, prune.json, reload/eval, and bad input (exit 2, nothing
written)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.train.config import TrainConfig

from ..cli_checks import cli_error

runner = CliRunner()


@pytest.fixture
def run_dir(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i:02d}.txt").write_text(f"line {i} of a small test document\n" * 40)
    folder = tmp_path / "run"
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=256, n_layers=2, num_experts=4, top_k=2, max_seq_len=64)
    save_model(MoETransformer(cfg), folder)
    ByteTokenizer().save(folder)
    train = TrainConfig(data=str(data), val_fraction=0.5, seq_len=32).to_dict()
    (folder / "run.json").write_text(json.dumps({"model": cfg.to_dict(), "train": train}))
    return folder


@pytest.mark.parametrize("method", ["ragep", "naee"])
def test_prune_writes_a_run_that_reloads_and_evaluates(run_dir, tmp_path, method):
    out = tmp_path / "pruned"
    res = runner.invoke(app, ["prune", str(run_dir), "--method", method, "--keep", "0.75",
                              "--calib-tokens", "256", "--pca-rank", "2", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads((out / "prune.json").read_text())
    assert report["budget"] == 6 and report["method"] == method
    assert sum(r["kept"] for r in report["layers"]) == 6
    assert all(r["effective_rank"] > 0 for r in report["layers"])
    model = load_model(out)
    assert [b.ffn.experts.num_experts for b in model.blocks] == [
        r["kept"] for r in report["layers"]
    ]
    info = json.loads((out / "run.json").read_text())
    assert ModelConfig.from_dict(info["model"]) == model.cfg
    assert info["train"]["data"].endswith("corpus")
    ev = runner.invoke(app, ["eval", str(out), "--tokens", "64", "--json"])
    assert ev.exit_code == 0, ev.output
    assert "bits_per_byte" in ev.output


def test_bad_inputs_exit_2_and_write_nothing(run_dir, tmp_path):
    out = tmp_path / "p"
    base = ["prune", str(run_dir), "--out", str(out), "--calib-tokens", "64"]
    assert "keep" in cli_error(runner.invoke(app, [*base, "--keep", "0"]))
    assert "keep" in cli_error(runner.invoke(app, [*base, "--keep", "1.0"]))
    assert "keep" in cli_error(runner.invoke(app, [*base, "--keep", "8"]))
    assert "keep" in cli_error(runner.invoke(app, [*base, "--keep", "half"]))
    assert "below" in cli_error(runner.invoke(app, [*base, "--keep", "3"]))
    assert "method" in cli_error(runner.invoke(app, [*base, "--method", "magnitude"]))
    assert "per_layer" in cli_error(runner.invoke(app, [*base, "--per-layer", "deep"]))
    assert "calib_tokens" in cli_error(runner.invoke(app, [*base, "--calib-tokens", "99999999"]))
    assert not out.exists()
    out.mkdir()  # an empty folder (what a killed write leaves) would be reused; a full one not
    (out / "mine.txt").write_text("x")
    assert "exists and is not empty (choose a new or empty folder)" in cli_error(
        runner.invoke(app, [*base])
    )
    dense = tmp_path / "dense"
    save_model(MoETransformer(ModelConfig(vocab_size=256, d_model=16, n_heads=2, moe=None)), dense)
    ByteTokenizer().save(dense)
    assert "dense" in cli_error(
        runner.invoke(
            app,
            [
                "prune",
                str(dense),
                "--out",
                str(tmp_path / "q"),
                "--calib-data",
                str(run_dir.parent / "corpus"),
            ],
        )
    )
    bare = tmp_path / "bare"  # a model folder without run.json: no default calibration text
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256)), bare)
    ByteTokenizer().save(bare)
    assert "calib_data" in cli_error(
        runner.invoke(app, ["prune", str(bare), "--out", str(tmp_path / "q")])
    )
    assert "calib_data" in cli_error(
        runner.invoke(app, [*base[:3], str(tmp_path / "q"), "--calib-data", ""])
    )
    assert not (tmp_path / "q").exists()
