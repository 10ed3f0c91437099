"""Hostile and absurd inputs: crafted manifests, checkpoint indexes, shard indexes and
symlinks; outputs overlapping inputs; huge or non-finite config values; NaN weights;
missing or swapped run files; a corpus edited before a resume.

These run the real CLI (``moelab.cli.app`` through typer's runner, exit codes and stderr
as a user sees them) inside the test process, and the library's ``train`` for runs to
resume: each case is about file contents, so a child process per case would only add
start-up time. Every case must give exit code 2 with one line naming the file or field,
or the right result; nothing outside the folders involved is read, written or deleted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moelab.cli import app
from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.data import BPETokenizer
from moelab.models import ModelConfig
from moelab.train.checkpoint import ResumeWarning
from moelab.train.config import TrainConfig
from moelab.train.loop import train

from ..cli_checks import cli_error
from .conftest import assert_same_run

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def rewrite_manifest(folder, edit) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    edit(m["files"])
    (folder / "manifest.json").write_text(json.dumps(m))


def entry(path) -> dict:
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.fixture
def outside(tmp_path):
    """A folder that must never be read into, written or deleted."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("do not touch")
    return folder


def untouched(outside) -> bool:
    return (
        sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
        and (outside / "secret.txt").read_text() == "do not touch"
    )


# ------------------------------------------------------------ paths named inside files
def test_manifest_entry_absolute_path(finished_run):
    rewrite_manifest(finished_run, lambda f: f.update({"/etc/shadow": {"sha256": "0"}}))
    assert "absolute path" in cli_error(cli("eval", finished_run))


def test_manifest_entry_escapes_the_folder(finished_run, outside):
    rel = os.path.relpath(outside / "secret.txt", finished_run)
    rewrite_manifest(finished_run, lambda f: f.update({rel: entry(outside / "secret.txt")}))
    assert "leads outside the folder" in cli_error(cli("eval", finished_run))


def test_weights_symlinked_outside(finished_run, outside):
    real = outside / "model.safetensors"
    shutil.move(finished_run / "model.safetensors", real)
    (finished_run / "model.safetensors").symlink_to(real)
    assert "leads outside the folder" in cli_error(cli("eval", finished_run))
    assert real.is_file()


def test_shard_index_entry_escapes(finished_run, tmp_path, outside):
    hf = tmp_path / "hf"
    assert cli("convert", finished_run, hf, "--to", "hf").exit_code == 0
    shutil.copy(hf / "model.safetensors", outside / "x.safetensors")
    names = list(load_file(str(hf / "model.safetensors")))
    (hf / "model.safetensors").unlink()
    index = {"weight_map": {n: "../outside/x.safetensors" for n in names}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "leads outside the folder" in cli_error(cli("convert", hf, tmp_path / "back"))
    assert not (tmp_path / "back").exists()


def test_tokenizer_symlinked_outside_is_not_copied(finished_run, tmp_path, outside):
    hf = tmp_path / "hf"
    assert cli("convert", finished_run, hf, "--to", "hf").exit_code == 0
    (hf / "tokenizer.json").unlink(missing_ok=True)  # a BPE run's own tokenizer
    (hf / "tokenizer.json").symlink_to(outside / "secret.txt")
    assert "leads outside the folder" in cli_error(cli("convert", hf, tmp_path / "back"))
    assert not (tmp_path / "back").exists() and untouched(outside)


# --------------------------------------------------------------- runs to resume
STEPS = 6


def tiny_cfgs(corpus):
    model = ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
        moe=MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2),
            experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32),
        ),
    )  # fmt: skip
    cfg = TrainConfig(
        data=str(corpus), steps=STEPS, batch_size=4, seq_len=32, eval_every=3, eval_tokens=128,
        checkpoint_every=1, log_every=1, warmup_steps=1,
    )  # fmt: skip
    return model, cfg


@pytest.fixture(scope="module")
def lib_reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("libref") / "run"
    train(*tiny_cfgs(corpus), out, progress=False)
    return out


@pytest.fixture
def unfinished(corpus, tmp_path):
    """A run stopped after step 4 (checkpoints step-000003 and step-000004 kept)."""
    out = tmp_path / "run"
    assert train(*tiny_cfgs(corpus), out, progress=False, stop_after=4).interrupted
    return out


def resume(out):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(None, None, out, resume=True, progress=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]


def test_latest_json_escaping_is_ignored(unfinished, lib_reference, outside):
    rel = os.path.relpath(outside, unfinished / "checkpoints")
    (unfinished / "checkpoints" / "latest.json").write_text(
        json.dumps({"format_version": 1, "step": 99, "dir": rel})
    )
    _, warned = resume(unfinished)
    assert any("leads outside" in w for w in warned)
    assert_same_run(unfinished, lib_reference) and untouched(outside)


def test_missing_latest_json_resumes_from_the_newest_checkpoint(unfinished, lib_reference):
    (unfinished / "checkpoints" / "latest.json").unlink()
    result, _ = resume(unfinished)
    assert result.step == STEPS
    steps = [json.loads(x)["step"] for x in (unfinished / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # not restarted from step 0
    assert_same_run(unfinished, lib_reference)


def test_corrupt_newest_checkpoint_falls_back(unfinished, lib_reference):
    w = unfinished / "checkpoints" / "step-000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    _, warned = resume(unfinished)
    assert any("step-000004" in m and "truncated" in m for m in warned), warned
    assert_same_run(unfinished, lib_reference)


def test_newer_checkpoints_survive_a_fallback(unfinished):
    """Resuming from step 3 never deletes the (corrupt) step-4 one before replacing it."""
    ck = unfinished / "checkpoints"
    (ck / "step-000004" / "trainer_state.pt").write_bytes(b"junk")
    shutil.copytree(ck / "step-000004", ck / "step-000009")  # a newer one, e.g. a copy
    resume(unfinished)
    assert (ck / "step-000009").is_dir()


def test_checkpoint_symlinks_are_never_deleted_through(unfinished, outside):
    ck = unfinished / "checkpoints"
    (ck / "step-000001").symlink_to(outside, target_is_directory=True)
    (ck / ".step-000005.tmp").symlink_to(outside, target_is_directory=True)
    resume(unfinished)
    assert untouched(outside)


def test_checkpoints_folder_symlink_is_refused(unfinished, tmp_path):
    ck = unfinished / "checkpoints"
    moved = tmp_path / "elsewhere"
    shutil.move(ck, moved)
    ck.symlink_to(moved, target_is_directory=True)
    assert "symbolic link" in cli_error(
        cli("train", "--out", unfinished, "--resume", "--no-progress")
    )


def test_metrics_symlink_is_refused(unfinished, outside):
    (unfinished / "metrics.jsonl").unlink()
    (unfinished / "metrics.jsonl").symlink_to(outside / "secret.txt")
    assert "symbolic link" in cli_error(
        cli("train", "--out", unfinished, "--resume", "--no-progress")
    )
    assert untouched(outside)


def test_corpus_edited_before_resume(unfinished, corpus, tmp_path):
    edited = tmp_path / "corpus.txt"
    shutil.copy(corpus, edited)
    info = json.loads((unfinished / "run.json").read_text())
    info["train"]["data"] = str(edited)
    (unfinished / "run.json").write_text(json.dumps(info))
    with edited.open("a") as f:
        f.write("\n\nan extra document")
    line = cli_error(cli("train", "--out", unfinished, "--resume", "--no-progress"))
    assert "corpus changed" in line and "--allow-data-change" in line
    res = cli("train", "--out", unfinished, "--resume", "--no-progress", "--allow-data-change")
    assert res.exit_code == 0, res.output


def test_tokenizer_swapped_after_training(finished_run):
    BPETokenizer.train(["some text to learn merges from " * 20], vocab_size=300).save(finished_run)
    assert "tokenizer" in cli_error(cli("eval", finished_run))


def test_run_json_missing(finished_run, corpus):
    (finished_run / "run.json").unlink()
    assert "--data" in cli_error(cli("eval", finished_run))
    assert cli("eval", finished_run, "--data", corpus, "--tokens", "256").exit_code == 0


# ------------------------------------------------------- outputs overlapping inputs
def test_convert_onto_its_source(finished_run):
    before = sorted(p.name for p in finished_run.iterdir())
    assert "output is the input" in cli_error(
        cli("convert", finished_run, finished_run, "--to", "hf", "--overwrite")
    )
    assert "lies inside the input" in cli_error(
        cli("convert", finished_run, finished_run / "hf", "--to", "hf")
    )
    assert "contains the input" in cli_error(
        cli("convert", finished_run, finished_run.parent, "--to", "hf", "--overwrite")
    )
    assert sorted(p.name for p in finished_run.iterdir()) == before


def test_upcycle_into_a_parent_of_its_source(tmp_path):
    from moelab.data import ByteTokenizer
    from moelab.models import MoETransformer, save_model

    dense = tmp_path / "models" / "dense"
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256, moe=None)), dense)
    ByteTokenizer().save(dense)
    (tmp_path / "models" / "notes.txt").write_text("mine")
    line = cli_error(cli("upcycle", "--from", dense, "--out", tmp_path / "models", "--force"))
    assert "contains the input" in line
    assert (tmp_path / "models" / "notes.txt").is_file() and (dense / "model.safetensors").is_file()


def test_overwrite_never_deletes_foreign_files(finished_run, tmp_path):
    hf = tmp_path / "hf"
    assert cli("convert", finished_run, hf, "--to", "hf").exit_code == 0
    (hf / "my-notes.md").write_text("mine")
    assert "did not write" in cli_error(
        cli("convert", finished_run, hf, "--to", "hf", "--overwrite")
    )
    assert (hf / "my-notes.md").read_text() == "mine"


def test_analyze_out_is_not_overwritten_without_force(finished_run, tmp_path, corpus):
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.html").write_text("an earlier report")
    args = ["analyze", finished_run, "--data", corpus, "--tokens", "256", "--out", out]
    assert "--force" in cli_error(cli(*args))
    assert (out / "report.html").read_text() == "an earlier report"
    assert "contains the input" in cli_error(cli(*args[:-1], finished_run, "--force"))


# ------------------------------------------------------------ absurd config values
@pytest.mark.parametrize(
    "flags", [["--capacity-factor", "inf"], ["--aux-coeff", "inf"], ["--lr", "nan"]]
)
def test_non_finite_flags(tmp_path, corpus, flags):
    line = cli_error(
        cli("train", "--data", corpus, "--out", tmp_path / "r", "--steps", "1", *flags)
    )
    assert line.startswith(f"error: {flags[0]}: must be a finite number")  # the flag typed
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("section", "body", "field"),
    [
        ("model", "rope_theta: .inf", "rope_theta"),
        ("model", "moe: {experts: {ffn_hidden_size: 32.5}}", "ffn_hidden_size"),
        ("train", "seed: 1.0e+23", "seed"),
        ("train", "seed: 100000000000000000000000", "seed"),
        ("model", "moe: {router: {num_experts: 1000000000, top_k: 1}}", "memory"),
    ],
)
def test_absurd_config_file_values(tmp_path, corpus, section, body, field):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"{section}:\n  {body}\n")
    t0 = time.perf_counter()
    line = cli_error(cli("train", "--config", cfg, "--data", corpus, "--out", tmp_path / "r"))
    assert field in line and not (tmp_path / "r").exists()
    assert time.perf_counter() - t0 < 30  # refused before allocating anything


@pytest.mark.parametrize("experts", [1e9, 1000000000])
def test_hf_config_with_a_billion_experts(finished_run, tmp_path, experts):
    hf = tmp_path / "hf"
    assert cli("convert", finished_run, hf, "--to", "hf").exit_code == 0
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_local_experts"] = experts
    (hf / "config.json").write_text(json.dumps(cfg))
    res = cli("convert", hf, tmp_path / "back")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert (
        "num_local_experts" in res.output or "num_experts" in res.output or "memory" in res.output
    )
    assert not (tmp_path / "back").exists()


def _tamper_weights(folder, edit) -> None:
    w = folder / "model.safetensors"
    tensors = edit(load_file(str(w)))
    save_file(tensors, str(w), metadata={"format_version": "1"})
    rewrite_manifest(folder, lambda f: f.update({"model.safetensors": entry(w)}))


def test_int32_weights(finished_run):
    _tamper_weights(finished_run, lambda t: {**t, "norm.weight": t["norm.weight"].to(torch.int32)})
    assert "dtype torch.int32" in cli_error(cli("eval", finished_run))


# ------------------------------------------------------------- non-finite results
def test_nan_weights_are_an_error_not_a_number(finished_run):
    _tamper_weights(
        finished_run, lambda t: {**t, "norm.weight": torch.full_like(t["norm.weight"], math.nan)}
    )
    assert "not finite" in cli_error(cli("eval", finished_run))
    res = cli("eval", finished_run, "--json")
    assert res.exit_code == 2 and "NaN" not in res.stdout.replace("error", "")
    res = cli("generate", finished_run, "--temperature", "0", "--prompt", "ab")
    assert res.exit_code == 2 and "not finite" in res.stderr
    assert res.stdout.strip() == "ab"  # the prompt echo only: no token sampled from NaN


def test_files_follow_the_umask(finished_run):
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("model.safetensors", "manifest.json", "run.json", "metrics.jsonl"):
        assert (finished_run / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_analysis_folder_symlinked_outside(finished_run, corpus, outside):
    (finished_run / "analysis").symlink_to(outside, target_is_directory=True)
    line = cli_error(cli("analyze", finished_run, "--data", corpus, "--tokens", "256"))
    assert "symbolic link" in line and untouched(outside)


def test_imported_tokenizer_is_checksummed(finished_run, corpus, tmp_path):
    """Tokenizer files copied in by convert are in the manifest: a later swap is caught."""
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert cli("convert", finished_run, hf, "--to", "hf").exit_code == 0
    (hf / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    assert cli("convert", hf, back).exit_code == 0
    assert "tokenizer.json" in json.loads((back / "manifest.json").read_text())["files"]
    (back / "tokenizer.json").write_text('{"version": "1.0", "model": {"swapped": 1}}')
    assert "tokenizer.json" in cli_error(cli("eval", back, "--data", corpus))
