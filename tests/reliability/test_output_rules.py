"""One rule set for every writer, and outputs that are usable or refused:

- expand, merge-lora, prune, quantize refuse an output inside (or around) their source; an
  empty output folder left by a killed write is reusable;
- a lossless store is never taken for an unfinished run (prune/quantize/analyze refuse it,
  and ``train --resume`` does not train into it);
- SIGTERM during a folder write removes its temporaries as SIGINT does, and the hidden
  temporaries a SIGKILL left are removed by the next write of that folder;
- what cannot be represented is refused: a quantized model into a lossless store, a
  block-diffusion model to Hugging Face;
- weights written inside an output folder get the umask's mode, not 0600.

Signals are sent to real ``moelab`` processes (``inject.py``); the rest runs the CLI in this
process.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model
from moelab.models.block_diffusion import to_block_diffusion
from moelab.models.lora import add_expert_lora

from ..cli_checks import cli_error
from .conftest import leftovers, moelab_proc

runner = CliRunner()
CALIB = ["--calib-tokens", "256", "--seq-len", "32", "--batch-size", "4"]


def _hidden(folder) -> list[str]:
    """Hidden temporaries beside and inside ``folder``'s parent."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    r = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat"]
    (root / "corpus.txt").write_text(
        "\n\n".join(" ".join(r.choice(words) for _ in range(80)) for _ in range(20))
    )
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=256, max_seq_len=64)
    for name, model in (
        ("model", MoETransformer(cfg)),
        ("lora", add_expert_lora(MoETransformer(cfg), 2)),
        ("bd", to_block_diffusion(MoETransformer(ModelConfig.tiny(vocab_size=257)), 4)),
    ):
        save_model(model.eval(), root / name)
        ByteTokenizer().save(root / name)
    store = runner.invoke(app, ["compress", str(root / "model"), "--lossless", "--out",
                                str(root / "store"), "--profile-tokens", "0"])  # fmt: skip
    assert store.exit_code == 0, store.output
    return root


# ------------------------------------------------------------ outputs inside the source
@pytest.mark.parametrize(
    "args",
    [
        ["expand", "{run}", "--hidden", "2x", "--out", "{run}/wide"],
        ["merge-lora", "{lora}", "--out", "{lora}/merged"],
        ["prune", "{run}", "--out", "{run}/pruned"],
        ["quantize", "{run}", "--out", "{run}/q"],
    ],
)
def test_no_writer_puts_its_output_inside_its_source(src, args):
    paths = {"run": src / "model", "lora": src / "lora"}
    line = cli_error(runner.invoke(app, [a.format(**paths) for a in args]))
    assert "the output lies inside the input" in line
    assert sorted(p.name for p in (src / "model").iterdir()) == sorted(
        p.name for p in (src / "model").iterdir() if p.name in {
            "config.json", "model.safetensors", "manifest.json", "tokenizer_meta.json",
            ".moelab-output.json",
        }
    )  # fmt: skip


def test_merge_lora_writes_a_folder_atomically_with_the_umask_modes(src, tmp_path):
    out = tmp_path / "merged"
    done = runner.invoke(app, ["merge-lora", str(src / "lora"), "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert (out / ".moelab-output.json").is_file() and not leftovers(tmp_path)


# ------------------------------------------------------------ a store is not a run
@pytest.mark.parametrize(
    "args",
    [
        ["prune", "{store}", "--out", "{tmp}/p", *CALIB],
        ["quantize", "{store}", "--out", "{tmp}/q", *CALIB],
        ["analyze", "{store}", "--out", "{tmp}/a"],
        ["train", "--out", "{store}", "--resume"],
    ],
)
def test_a_store_is_never_an_unfinished_run(src, tmp_path, args):
    before = sorted(p.name for p in (src / "store").iterdir())
    line = cli_error(
        runner.invoke(app, [a.format(store=src / "store", tmp=tmp_path) for a in args])
    )
    assert "a lossless expert store, not a run" in line and "--resume" not in line
    assert sorted(p.name for p in (src / "store").iterdir()) == before


# ------------------------------------------------------------ refused: cannot be represented
def test_a_quantized_model_is_refused_by_the_lossless_store(src, tmp_path):
    q = tmp_path / "q"
    done = runner.invoke(app, ["quantize", str(src / "model"), "--out", str(q), "--method",
                               "rtn", "--group-size", "16", "--calib-data",
                               str(src / "corpus.txt"), *CALIB])  # fmt: skip
    assert done.exit_code == 0, done.output
    line = cli_error(runner.invoke(app, ["compress", str(q), "--lossless", "--out",
                                    str(tmp_path / "z"), "--profile-tokens", "0"]))  # fmt: skip
    assert "a quantized model cannot go into a lossless store" in line
    assert not (tmp_path / "z").exists()


def test_a_block_diffusion_model_does_not_export_as_a_causal_lm(src, tmp_path):
    line = cli_error(runner.invoke(app, ["convert", str(src / "bd"), str(tmp_path / "hf"),
                                    "--to", "hf"]))  # fmt: skip
    assert "objective: mixtral is a causal LM; a block_diffusion model has no" in line
    assert not (tmp_path / "hf").exists()


def test_weights_in_output_folders_get_the_umask_mode(src, tmp_path):
    old = os.umask(0o022)
    try:
        hf = runner.invoke(app, ["convert", str(src / "model"), str(tmp_path / "hf"),
                                 "--to", "hf"])  # fmt: skip
    finally:
        os.umask(old)
    assert hf.exit_code == 0, hf.output
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    # the store of the fixture was written under the test process's umask
    mode = 0o666 & ~old
    assert (src / "store" / "dense.safetensors").stat().st_mode & 0o777 == mode


# ------------------------------------------------------------ signals during a write
@pytest.mark.slow
def test_sigterm_during_a_store_write_leaves_no_temporaries(src, tmp_path):
    out = tmp_path / "store"
    proc = moelab_proc(
        "compress", str(src / "model"), "--lossless", "--out", str(out), "--profile-tokens", "0",
        fault=("term", "moelab.compress.lossless.model_store:save_file", 1, "after"),
    )  # fmt: skip
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "aborted" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and _hidden(out) == [] and not leftovers(tmp_path)


@pytest.mark.slow
def test_after_a_sigkill_the_output_folder_and_its_temporaries_are_reusable(src, tmp_path):
    out = tmp_path / "q"
    args = ["quantize", str(src / "model"), "--out", str(out), "--method", "rtn",
            "--group-size", "16", "--calib-data", str(src / "corpus.txt"), *CALIB]  # fmt: skip
    killed = moelab_proc(*args, fault=("kill", "moelab.models.io:save_file", 1, "after"))
    assert killed.returncode == -9, killed.stderr
    assert out.is_dir() and not any(out.iterdir())  # the empty folder the write made
    assert len([n for n in _hidden(out) if n.startswith(".q.")]) == 1  # its temporary
    again = moelab_proc(*args)
    assert again.returncode == 0, again.stderr
    assert (out / "quantize.json").is_file() and _hidden(out) == []
