"""convert() and the `moelab convert` command: HF ↔ moelab folders, tokenizer, atomicity."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from moelab.cli.convert import convert_command
from moelab.interop import HF_SOURCE_FILE, InteropError, convert, export_hf, import_hf
from moelab.interop import hf as hf_module
from moelab.models import ModelConfig, MoETransformer, load_model
from moelab.utils.outdir import OutputFolderError

app = typer.Typer()
app.command("convert")(convert_command)
app.command("noop")(lambda: None)  # keep "convert" a subcommand


def _ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))


def test_cli_round_trip_hf_moelab_hf(hf, tmp_path):
    ref = hf.model("qwen3_moe", seed=2)
    src = hf.save(ref, tmp_path / "hf", "per_expert")
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    runner = CliRunner()
    res = runner.invoke(
        app, ["convert", str(src), str(tmp_path / "ml"), "--to", "moelab", "--json"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["arch"] == "qwen3_moe" and "tokenizer.json" in report["copied_files"]
    assert (tmp_path / "ml" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "ml" / HF_SOURCE_FILE).read_text())["arch"] == "qwen3_moe"
    model = load_model(tmp_path / "ml")
    with torch.no_grad():
        assert float((model(_ids()).logits - ref(_ids()).logits).abs().max()) < 1e-4

    res = runner.invoke(
        app,
        [
            "convert",
            str(tmp_path / "ml"),
            str(tmp_path / "back"),
            "--to",
            "hf",
            "--layout",
            "fused",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "qwen3_moe" in res.output and "tokenizer.json" in res.output
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, ref(_ids()).logits)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["eos_token_id"] == ref.config.eos_token_id  # restored from hf_source.json
    assert (tmp_path / "back" / "tokenizer.json").is_file()


def test_no_tokenizer_is_noted(hf, tmp_path):
    src = hf.save(hf.model("mixtral"), tmp_path / "hf", "fused")
    _, meta = import_hf(src)
    assert any("no tokenizer.json" in n for n in meta.notes)
    report = convert(src, tmp_path / "ml", "moelab")
    assert "tokenizer.json" not in report.copied_files and any(
        "no tokenizer" in n for n in report.notes
    )


def test_cli_errors_exit_nonzero(tmp_path):
    runner = CliRunner()
    res = runner.invoke(
        app, ["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "moelab"]
    )
    assert res.exit_code == 2 and res.output.startswith("error:")
    res = runner.invoke(app, ["convert", str(tmp_path), str(tmp_path / "x"), "--to", "onnx"])
    assert (
        res.exit_code == 2
        and res.output.strip() == "error: --to: must be 'moelab', 'hf' or 'gguf', got 'onnx'"
    )


def test_convert_bad_direction(tmp_path):
    with pytest.raises(ValueError, match="direction"):
        convert(tmp_path, tmp_path / "x", "onnx")


def test_convert_arch_mismatch(hf, tmp_path):
    src = hf.save(hf.model("olmoe"), tmp_path / "hf", "fused")
    with pytest.raises(InteropError, match="arch"):
        convert(src, tmp_path / "ml", "moelab", arch="mixtral")
    assert not (tmp_path / "ml").exists()


def test_export_refuses_non_empty_folder_and_overwrites_on_request(tmp_path):
    model = MoETransformer(ModelConfig.tiny())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_hf(model, out, "mixtral")
    with pytest.raises(OutputFolderError, match=r"not written by moelab"):
        export_hf(model, out, "mixtral", overwrite=True)  # never deletes the user's files
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    export_hf(model, out, "mixtral")
    export_hf(model, out, "mixtral", overwrite=True)  # a folder moelab wrote is replaced
    names = sorted(p.name for p in out.iterdir())
    assert names == [".moelab-output.json", "config.json", "model.safetensors"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match=r"notes\.txt"):
        export_hf(model, out, "mixtral", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_module, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export_hf(MoETransformer(ModelConfig.tiny()), tmp_path / "out", "mixtral")
    assert list(tmp_path.iterdir()) == []


def test_export_infers_arch(tmp_path):
    for kw, arch in [
        (dict(qk_norm="head"), "qwen3_moe"),
        (dict(qk_norm="full"), "olmoe"),
        (dict(), "mixtral"),
    ]:
        out = export_hf(MoETransformer(ModelConfig.tiny(**kw)), tmp_path / arch)
        assert json.loads((out / "config.json").read_text())["model_type"] == arch


def test_moelab_model_exports_to_transformers(hf, tmp_path):
    """A model born in moelab (tied embeddings, GQA) loads in transformers with equal logits."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=97, n_kv_heads=2, tie_embeddings=True, qk_norm="head")
    model = hf.randomise(MoETransformer(cfg).eval(), seed=3)
    export_hf(model, tmp_path / "out", "qwen3_moe", layout="fused")
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        diff = float((back(_ids()).logits - model(_ids()).logits).abs().max())
    assert diff < 1e-4
