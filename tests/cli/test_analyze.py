import json
from html.parser import HTMLParser

import torch
from typer.testing import CliRunner

from moelab.analysis.collect import collect
from moelab.cli import app
from moelab.data import ByteTokenizer, Document, TokenStream
from moelab.models import ModelConfig, MoETransformer, save_model

runner = CliRunner()


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def test_analyze_command_writes_json_plots_and_report(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256, n_layers=2)), run)
    ByteTokenizer().save(run)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    result = runner.invoke(
        app, ["analyze", str(run), "--data", str(corpus), "--tokens", "512", "--seq-len", "32"]
    )
    assert result.exit_code == 0, result.output
    out = run / "analysis"
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis["num_layers"] == 2 and analysis["domain_names"] == ["user"]
    pngs = sorted((out / "plots").glob("*.png"))
    assert len(pngs) >= 4
    parser = _Images()
    parser.feed((out / "report.html").read_text())
    assert len(parser.srcs) == len(pngs)
    assert all(s.startswith("data:image/png;base64,") for s in parser.srcs)


def test_collect_routes_every_token_once_per_layer_and_labels_domains():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=256, n_layers=3, first_dense_layers=1))
    tok = ByteTokenizer()
    docs = [Document("a", "prose", "hello there " * 30), Document("b", "code", "x = f(y)\n" * 40)]
    names = ["code", "prose"]
    streams = {
        n: TokenStream.from_documents([d for d in docs if d.domain == n], tok, domain_names=names)
        for n in names
    }
    got = collect(
        model,
        streams,
        seq_len=16,
        batch_size=4,
        max_tokens=128,
        sample_tokens=64,
        redundancy_tokens=8,
    )
    assert len(got.routing.layers) == 2  # the dense first layer has no router
    for lay in got.routing.layers:
        assert lay.counts.sum().item() == 2 * 2 * 128  # k=2 pairs per token
        # the first stream is "code" (label 0), the second "prose": 2 pairs per token each
        assert lay.domain_counts.sum(1).tolist() == [2 * 128, 2 * 128]
    assert got.hidden_by_layer[0].shape == (64, 32)
    assert got.expert_outputs_by_layer[0].shape == (4, 8, 32)
