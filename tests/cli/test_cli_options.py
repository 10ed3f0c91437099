"""Training flags are generated from the config dataclasses; user errors are one line, bugs
keep their traceback, ``--debug`` shows both."""

from __future__ import annotations

import typing

import pytest
from typer.testing import CliRunner

from moelab.cli import app, build_configs
from moelab.cli._options import field_type
from moelab.cli.train import MODEL_OPTIONS, TRAIN_OPTIONS
from moelab.errors import InvalidValueError, UserError
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig

runner = CliRunner()


def test_every_option_names_a_real_field_and_shows_in_help():
    for root, options in ((ModelConfig, MODEL_OPTIONS), (TrainConfig, TRAIN_OPTIONS)):
        for opt in options:
            field_type(root, opt.field)  # raises KeyError for a stale path
    text = runner.invoke(app, ["train", "--help"], terminal_width=200).output
    for flag in (
        "--norm-topk-prob",
        "--no-norm-topk-prob",
        "--group-score",
        "--top-k",
        "--time-budget",
    ):
        assert flag in text, flag
    assert "sqrtsoftplus" in text and "sinkhorn" in text  # Literal choices come from the field


def test_literal_annotation_is_a_string_flag():
    hint = field_type(ModelConfig, "moe.router.score_func")
    assert typing.get_origin(hint) is typing.Literal


def test_top1_flag_defaults_to_unnormalised_weights_and_flag_overrides():
    model, _ = build_configs(None, {"top_k": 1}, {}, dense=False)
    assert model.moe.router.top_k == 1 and model.moe.router.norm_topk_prob is False
    model, _ = build_configs(None, {"top_k": 2}, {}, dense=False)
    assert model.moe.router.norm_topk_prob is True
    with pytest.warns(UserWarning, match="no gradient"):
        model, _ = build_configs(None, {"top_k": 1, "norm_topk_prob": True}, {}, dense=False)
    assert model.moe.router.norm_topk_prob is True


def test_train_defaults_to_a_512_token_bpe_that_a_file_or_flag_overrides(tmp_path):
    _, train = build_configs(None, {}, {}, dense=False)
    assert (train.tokenizer, train.bpe_vocab_size) == ("bpe", 512)
    assert TrainConfig().tokenizer == "byte"  # the library's default is unchanged
    _, train = build_configs(None, {}, {"tokenizer": "byte"}, dense=False)
    assert train.tokenizer == "byte"
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  bpe_vocab_size: 1024\n")
    _, train = build_configs(cfg, {}, {}, dense=False)
    assert (train.tokenizer, train.bpe_vocab_size) == ("bpe", 1024)


def test_new_router_flags_reach_the_config():
    model, train = build_configs(
        None,
        {"router": "sinkhorn", "score_func": "sigmoid", "experts": 4, "top_k": 1},
        {"time_budget": 12.0, "adam_eps": 1e-6},
        dense=False,
    )
    r = model.moe.router
    assert (r.kind, r.score_func, r.num_experts) == ("sinkhorn", "sigmoid", 4)
    assert (train.time_budget_s, train.eps) == (12.0, 1e-6)


def test_user_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ["train", "--out", str(tmp_path / "r"), "--score-func", "tanh", "--no-progress"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: score_func")
    assert len(result.output.strip().splitlines()) == 1
    debug = runner.invoke(app, ["--debug", *args])
    assert isinstance(debug.exception, InvalidValueError) and isinstance(debug.exception, UserError)


def test_internal_bug_keeps_its_traceback(tmp_path, monkeypatch):
    import moelab.train.loop as loop

    def broken(*a, **k):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(loop, "train", broken)
    result = runner.invoke(app, ["train", "--out", str(tmp_path / "r"), "--steps", "1"])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)
    assert not isinstance(result.exception, UserError)


def test_debug_does_not_leak_into_the_next_command(tmp_path):
    from moelab.core import checks

    runner.invoke(app, ["--debug", "train", "--out", str(tmp_path / "r"), "--score-func", "x"])
    assert checks.value_checks()
    result = runner.invoke(app, ["train", "--out", str(tmp_path / "r"), "--score-func", "x"])
    assert result.exit_code == 2 and not checks.value_checks()
