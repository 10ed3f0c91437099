"""`moelab analyze` on an imported Hugging Face MoE checkpoint (with its tokenizer.json)."""

import json

from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import BPETokenizer

runner = CliRunner()
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


def test_convert_then_analyze_an_olmoe_checkpoint(hf, tmp_path):
    tok = BPETokenizer.train([TEXT], vocab_size=300)
    model = hf.model("olmoe", vocab_size=tok.vocab_size)
    src = hf.save(model, tmp_path / "hf", "per_expert")
    tok.save(tmp_path / "tok")
    (src / "tokenizer.json").write_text((tmp_path / "tok" / "tokenizer.json").read_text())
    dst = tmp_path / "moelab"
    assert runner.invoke(app, ["convert", str(src), str(dst), "--to", "moelab"]).exit_code == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    result = runner.invoke(
        app, ["analyze", str(dst), "--data", str(corpus), "--tokens", "256", "--seq-len", "16"]
    )
    assert result.exit_code == 0, result.output
    analysis = json.loads((dst / "analysis" / "analysis.json").read_text())
    assert analysis["num_layers"] == 2 and analysis["num_experts"] == [4, 4]
    assert (dst / "analysis" / "report.html").exists()
