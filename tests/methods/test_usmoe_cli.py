"""USMoE through the CLI: causal scopes by default, non-causal ones only when asked."""

import json

from typer.testing import CliRunner

from moelab.cli import app
from moelab.models import load_model

runner = CliRunner()

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--expert-ffn", "32", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
        "--eval-tokens", "32", "--eval-every", "2", "--no-progress", "--router", "usmoe"]  # fmt: skip


def _corpus(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Mixture of experts route tokens to experts. " * 200)
    return str(text)


def test_usmoe_trains_causally_without_balancing_by_default(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--data", _corpus(tmp_path), "--out", str(out), *TINY])
    assert res.exit_code == 0, res.output
    cfg = load_model(out).cfg.moe
    assert (cfg.router.kind, cfg.router.selection_scope) == ("usmoe", "position")
    assert cfg.losses.load_balance == "none"  # as released: no balancing gate
    (tmp_path / "c.yaml").write_text("model:\n  moe:\n    losses:\n      load_balance: seq\n")
    res = runner.invoke(
        app, ["train", "--data", _corpus(tmp_path), "--out", str(tmp_path / "r2"), *TINY,
              "--config", str(tmp_path / "c.yaml"), "--steps", "1"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert load_model(tmp_path / "r2").cfg.moe.losses.load_balance == "seq"  # given: kept
    res = runner.invoke(app, ["eval", str(out), "--json", "--tokens", "64"])
    assert res.exit_code == 0, res.output
    assert "note" not in json.loads(res.output)


def test_noncausal_scope_is_refused_unless_allowed(tmp_path):
    data = _corpus(tmp_path)
    seq = [*TINY, "--usmoe-scope", "sequence"]
    res = runner.invoke(app, ["train", "--data", data, "--out", str(tmp_path / "r1"), *seq])
    assert res.exit_code == 2 and "not a causal LM" in res.output
    assert "--allow-noncausal-routing" in res.output
    out = tmp_path / "r2"
    res = runner.invoke(
        app, ["train", "--data", data, "--out", str(out), *seq, "--allow-noncausal-routing"]
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["eval", str(out), "--tokens", "64"])
    assert res.exit_code == 2 and "--allow-noncausal-routing" in res.output
    res = runner.invoke(
        app, ["eval", str(out), "--tokens", "64", "--json", "--allow-noncausal-routing"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["note"].startswith("not a causal LM score")
