"""upcycle_command: run folder written atomically, loadable, with clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from moelab.cli.upcycle import UPCYCLE_FILE, upcycle_command
from moelab.data.tokenizer import BPETokenizer, load_tokenizer
from moelab.models import load_model, save_model
from moelab.train.upcycle import max_logit_diff

from .conftest import make_dense


@pytest.fixture
def source(tmp_path):
    texts = ["the cat sat on the mat", "capital of France is Paris", "experts route tokens"] * 20
    tok = BPETokenizer.train(texts, 300, min_frequency=2)
    model = make_dense(vocab_size=tok.vocab_size, seed=4)
    folder = tmp_path / "dense"
    save_model(model, folder)
    tok.save(folder)
    return folder


def test_writes_a_loadable_run_folder(source, tmp_path):
    out = tmp_path / "runs" / "up"
    res = upcycle_command(source, out, experts=4, top_k=2, granularity=2, seed=1)
    assert res.num_experts == 8 and res.top_k == 4 and res.complete_copies
    assert res.max_abs_logit_diff < 1e-5 < res.max_abs_logit
    moe, tok = load_model(out), load_tokenizer(out)
    assert moe.cfg.moe.router.num_experts == 8 and moe.cfg.moe.experts.ffn_hidden_size == 24
    assert tok.encode("the cat") == load_tokenizer(source).encode("the cat")
    info = json.loads((out / UPCYCLE_FILE).read_text())
    assert info["copies"] == 4 and info["granularity"] == 2 and info["seed"] == 1
    dense = load_model(source).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    assert max_logit_diff(dense, moe.eval(), ids) < 2e-6
    assert sorted(p.name for p in out.parent.iterdir()) == ["up"]  # no temp folders left


def test_refuses_to_overwrite_without_force(source, tmp_path):
    out = tmp_path / "up"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="force"):
        upcycle_command(source, out, experts=2, top_k=1)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="not written by moelab"):
        upcycle_command(source, out, experts=2, top_k=1, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    upcycle_command(source, out, experts=2, top_k=1)
    upcycle_command(source, out, experts=4, top_k=1, force=True)  # moelab's own folder: replaced
    assert load_model(out).cfg.moe.router.num_experts == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "up"]


def test_empty_out_folder_is_fine(source, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    upcycle_command(source, out, experts=2, top_k=2)
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(experts=0, top_k=1), "experts"),
        (dict(experts=2, top_k=3), "top_k"),
        (dict(experts=2, top_k=1, granularity=5), "granularity"),
        (dict(experts=2, top_k=1, granularity=0), "granularity"),
        (dict(experts=2, top_k=1, router_init="nope"), "router_init"),
    ],
)
def test_bad_arguments(source, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        upcycle_command(source, tmp_path / "o", **kwargs)
    assert not (tmp_path / "o").exists()


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="source"):
        upcycle_command("no-such-model", tmp_path / "o", experts=2, top_k=1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"source.*no loadable moelab model"):
        upcycle_command(empty, tmp_path / "o", experts=2, top_k=1)
    model_only = tmp_path / "m"
    save_model(make_dense(), model_only)
    with pytest.raises(ValueError, match=r"source.*no tokenizer"):
        upcycle_command(model_only, tmp_path / "o", experts=2, top_k=1)
    assert not (tmp_path / "o").exists()


def test_moe_source_refused(source, tmp_path):
    out = tmp_path / "up"
    upcycle_command(source, out, experts=2, top_k=1)
    with pytest.raises(ValueError, match="already an MoE"):
        upcycle_command(out, tmp_path / "again", experts=2, top_k=1)
