"""``moelab compress --lossless`` and ``generate``/``eval --offload``: outputs equal the in-memory
run; bad input gives one line, exit 2 and no output folder."""

import json

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model

from ..cli_checks import cli_error

runner = CliRunner()


@pytest.fixture(scope="module")
def run_and_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=64)), root / "run")
    ByteTokenizer().save(root / "run")
    corpus = root / "text.txt"
    corpus.write_text("to be or not to be, that is the question. " * 40)
    r = runner.invoke(
        app,
        ["compress", str(root / "run"), "--lossless", "--out", str(root / "store"), "--dtype",
         "bf16", "--profile-data", str(corpus), "--profile-tokens", "256", "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return root, json.loads(r.output)


def test_compress_reports_sizes(run_and_store):
    root, report = run_and_store
    k = report["kinds"]["w_gate_up"]
    assert k["sign_mantissa"] == k["elements"] and 0 < k["exponent"] < k["elements"]
    assert (root / "store" / "profile.json").is_file()
    assert (root / "store" / "tokenizer_meta.json").is_file()


def test_offloaded_generate_equals_in_memory(run_and_store, tmp_path):
    root, _ = run_and_store
    # the in-memory reference: the same model cast to bf16 (what the store holds)
    from moelab.models import load_model

    ref = tmp_path / "ref"
    save_model(load_model(root / "run").to(torch.bfloat16), ref)
    ByteTokenizer().save(ref)
    args = ["--prompt", "to be", "--max-new-tokens", "20", "--temperature", "0"]
    want = runner.invoke(app, ["generate", str(ref), *args])
    assert want.exit_code == 0, want.output
    for policy in ("zipmoe", "lru"):
        got = runner.invoke(
            app,
            ["generate", str(root / "store"), *args, "--offload", "--cache-mb", "1",
             "--policy", policy, "--storage-mbps", "1000"],
        )  # fmt: skip
        assert got.exit_code == 0, got.output
        assert got.stdout.splitlines()[0] == want.stdout.splitlines()[0]
        assert "hit rate" in got.output


def test_offloaded_eval(run_and_store):
    root, _ = run_and_store
    r = runner.invoke(
        app,
        ["eval", str(root / "store"), "--offload", "--cache-mb", "1", "--data",
         str(root / "text.txt"), "--tokens", "256", "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "bits_per_byte" in r.output
    out = json.loads(r.stdout[r.stdout.index("{") :])
    st = out["offload"]  # every expert request of the scored tokens is a hit or a miss
    assert st["requests"] > 0 and st["hits_full"] + st["hits_sm"] + st["misses"] == st["requests"]
    assert st["bytes_read"] > 0 and st["seconds"] > 0


def test_bad_inputs(run_and_store, tmp_path):
    root, _ = run_and_store
    store = str(root / "store")
    assert "smaller than one layer" in cli_error(
        runner.invoke(app, ["generate", store, "--offload", "--cache-mb", "0.01"])
    )
    assert "cache_mb" in cli_error(runner.invoke(app, ["generate", store, "--offload"]))
    assert "need --offload" in cli_error(runner.invoke(app, ["generate", store, "--cache-mb", "3"]))
    assert "with --offload --cache-mb" in cli_error(runner.invoke(app, ["generate", store]))
    assert "store.json" in cli_error(
        runner.invoke(app, ["generate", str(root / "run"), "--offload", "--cache-mb", "3"])
    )
    out = tmp_path / "o"
    assert "--lossless" in cli_error(
        runner.invoke(app, ["compress", str(root / "run"), "--out", str(out)])
    )
    assert "codec" in cli_error(
        runner.invoke(
            app, ["compress", str(root / "run"), "--lossless", "--out", str(out), "--codec", "lz5"]
        )
    )
    assert not out.exists()
    assert "already a lossless expert store" in cli_error(
        runner.invoke(app, ["compress", store, "--lossless", "--out", str(out)])
    )
    inside = root / "run" / "zip"
    assert "inside the input" in cli_error(
        runner.invoke(app, ["compress", str(root / "run"), "--lossless", "--out", str(inside)])
    )
    assert not inside.exists()
    for n in ("0", "65"):
        assert "chunks" in cli_error(
            runner.invoke(
                app, ["compress", str(root / "run"), "--lossless", "--out", str(out), "--chunks", n]
            )
        )
    assert not out.exists()
    torch.manual_seed(0)
    half = tmp_path / "half"
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256)).to(torch.float16), half)
    ByteTokenizer().save(half)
    assert "bfloat16 and float32" in cli_error(
        runner.invoke(
            app, ["compress", str(half), "--lossless", "--out", str(out), "--profile-tokens", "0"]
        )
    )
    assert not out.exists()


def test_tampered_pack_fails_before_any_output(run_and_store, tmp_path):
    import shutil

    root, _ = run_and_store
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    index = json.loads((store / "store.json").read_text())
    ref = index["experts"][-1]["tensors"]["w_down"]["sm"]
    with open(store / "experts.pack", "r+b") as f:
        f.seek(ref["offset"])
        b = f.read(1)
        f.seek(ref["offset"])
        f.write(bytes([b[0] ^ 1]))
    for cmd in (["generate", "--prompt", "hello"], ["eval"]):
        r = runner.invoke(app, [cmd[0], str(store), *cmd[1:], "--offload", "--cache-mb", "3"])
        assert "checksum mismatch" in cli_error(r) and "hello" not in r.output
    assert "finite" in cli_error(
        runner.invoke(app, ["generate", str(root / "store"), "--offload", "--cache-mb", "inf"])
    )
