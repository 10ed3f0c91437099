"""``moelab consolidate``: the output-folder rules, the step it wrote named in the output and
on screen, a finished run refused (its final model is the run folder itself), and a missing
shard as one error line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from parallel_workers import save_at
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import load_model
from moelab.parallel.checkpoint import CONSOLIDATED_FILE, latest_sharded_dir
from moelab.parallel.launch import spawn_ranks

from ..cli_checks import cli_error

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ep") / "run"
    saved = spawn_ranks(save_at, 2, ep=2, folder=str(run))[0]
    ByteTokenizer().save(run)
    return run, saved["model"]


def test_consolidate_names_the_step_and_keeps_out_of_the_source(sharded_run, tmp_path):
    run, weights = sharded_run
    assert "lies inside the input" in cli_error(runner.invoke(app, ["consolidate", str(run),
                                                              str(run / "model")]))  # fmt: skip
    out = tmp_path / "model"
    done = runner.invoke(app, ["consolidate", str(run), str(out)])
    assert done.exit_code == 0, done.output
    assert "model folder of step 2 written to" in done.output
    record = json.loads((out / CONSOLIDATED_FILE).read_text())
    assert record["step"] == 2 and record["source"].endswith("step-000002")
    model = load_model(out)
    for k, v in weights.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert (out / "tokenizer_meta.json").is_file()


def test_a_finished_run_is_refused(sharded_run, tmp_path):
    run, _ = sharded_run
    finished = tmp_path / "finished"
    shutil.copytree(run, finished)
    (finished / "manifest.json").write_text("{}")
    line = cli_error(runner.invoke(app, ["consolidate", str(finished), str(tmp_path / "m")]))
    assert "the run finished, and its final model is this folder itself" in line


def test_a_missing_shard_is_one_line(sharded_run, tmp_path):
    run, _ = sharded_run
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    shards = sorted(latest_sharded_dir(broken).glob("*.distcp"))
    assert shards
    shards[-1].unlink()
    line = cli_error(runner.invoke(app, ["consolidate", str(broken), str(tmp_path / "m")]))
    assert f"shard file {shards[-1].name} is missing" in line
    assert not (tmp_path / "m").exists()
