"""``moelab edit apply`` on a tiny model folder; the edit folder generates with the engine."""

import json

from typer.testing import CliRunner

from moelab.cli import app
from moelab.models import save_model

runner = CliRunner()
LAYER = ["--layer", "blocks.1.ffn.w_down"]


def _folder(tiny, tmp_path):
    model, tok = tiny
    save_model(model, tmp_path / "m")
    tok.save(tmp_path / "m")
    return str(tmp_path / "m")


def test_apply_then_generate_from_the_edit_folder(tiny, tmp_path):
    folder = _folder(tiny, tmp_path)
    edits = tmp_path / "e.jsonl"
    edits.write_text(json.dumps({"prompt": "capital of X is ", "target": "Z"}) + "\n")
    out = tmp_path / "edited"
    res = runner.invoke(
        app, ["edit", "apply", folder, str(edits), "--out", str(out), "--method", "grace",
              "--steps", "60", *LAYER, "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["edits"][0]["accuracy"] == 100.0
    res = runner.invoke(
        app, ["generate", str(out), "--prompt", "capital of X is ", "--max-new-tokens", "1",
              "--temperature", "0"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.output.rstrip("\n").endswith("Z")
    res = runner.invoke(app, ["merge-lora", str(out), "--out", str(tmp_path / "merged")])
    assert res.exit_code == 2 and "an edit folder" in res.output  # not a model checkpoint


def test_bad_edit_files_and_layers_give_one_line_errors(tiny, tmp_path):
    folder = _folder(tiny, tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p"}) + "\n")
    res = runner.invoke(app, ["edit", "apply", folder, str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "bad.jsonl:1: missing field 'target'" in res.output
    good = tmp_path / "good.csv"
    good.write_text("prompt,target\na,b\nc,d\n")
    res = runner.invoke(
        app, ["edit", "apply", folder, str(good), "--out", str(tmp_path / "o"), "--layer", "nope"]
    )
    assert res.exit_code == 2 and "no module 'nope'" in res.output
    res = runner.invoke(
        app, ["edit", "apply", folder, str(good), "--out", str(tmp_path / "o"), *LAYER,
              "--capacity", "1"],
    )  # fmt: skip
    assert res.exit_code == 2 and "2 edits exceed the capacity" in res.output
    assert not (tmp_path / "o").exists()
