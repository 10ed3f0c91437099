"""``moelab train`` under torchrun with --expert-parallel: run folder, metrics, --resume at
another EP, and bad input (one error line, nonzero exit, nothing written or overwritten)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from parallel_workers import loop_train, write_corpus
from typer.testing import CliRunner

from moelab.cli import app
from moelab.models import load_model
from moelab.parallel.launch import free_port
from moelab.parallel.launch import spawn_ranks as run_ranks

runner = CliRunner()


def _train_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    return [r["loss"] for r in recs if r["split"] == "train"]


def _snapshot(folder):
    return {
        p.relative_to(folder): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_resume_at_another_layout_matches_uninterrupted_run(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    full, part = tmp_path / "full", tmp_path / "part"
    run_ranks(loop_train, 2, run_dir=str(full), corpus=str(corpus), ep=2)
    (r,) = {tuple(x.items()) for x in run_ranks(
        loop_train, 2, run_dir=str(part), corpus=str(corpus), ep=2, stop_after=3
    )}  # fmt: skip
    assert dict(r) == {"step": 3, "interrupted": True}
    assert (part / "checkpoints" / "step-000003" / "layout.json").is_file()
    assert not (part / "model.safetensors").exists()
    before = _snapshot(part)
    # a resume that does not fit: another world size, or without the parallel plan
    for extra in (["--expert-parallel", "1"], []):
        res = runner.invoke(app, ["train", "--out", str(part), "--resume", *extra])
        assert res.exit_code == 2, res.output
        assert res.output.strip().startswith("error:") and len(res.output.strip().splitlines()) == 1
    assert (
        "written by 2 ranks"
        in runner.invoke(
            app, ["train", "--out", str(part), "--resume", "--expert-parallel", "1"]
        ).output
    )
    assert _snapshot(part) == before
    # same world, EP 2 -> EP 1 with FSDP2 (model and AdamW state reshard from plain EP shards
    # to FSDP2 DTensors; the data order carries over)
    run_ranks(loop_train, 2, run_dir=str(part), corpus=None, ep=1, resume=True, fsdp=True)
    assert _train_losses(part) == pytest.approx(_train_losses(full), rel=1e-5)
    a, b = load_model(full).state_dict(), load_model(part).state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
    assert (full / "run.json").is_file() and (full / "tokenizer_meta.json").is_file()


@pytest.mark.slow
def test_torchrun_bad_expert_parallel_prints_once_and_writes_nothing(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "moelab.cli", "train",
        "--data", str(corpus), "--out", str(out), "--experts", "3", "--top-k", "2",
        "--expert-parallel", "2", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--steps", "1", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert text.count("error:") == 1, text
    assert "does not divide the 3 experts" in text
    assert not out.exists()


def test_expert_parallel_must_divide_world_size(tmp_path):
    res = runner.invoke(
        app, ["train", "--out", str(tmp_path / "r"), "--expert-parallel", "2", "--steps", "1"]
    )
    assert res.exit_code == 2
    assert "dividing the world size 1" in res.output
    assert not (tmp_path / "r").exists()
