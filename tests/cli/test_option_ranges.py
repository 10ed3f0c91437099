"""Every numeric option of every command is checked in one place before the command runs
(finite floats, ints within range, declared ranges, 64-bit seeds), and models that prune,
quantize, upcycle or a diffusion decoder cannot take are refused in one line before any
work."""

from __future__ import annotations

import dataclasses
import json
import random
import typing

import pytest
import torch
import typer
from typer.testing import CliRunner

from moelab.cli import app
from moelab.core.config import ExpertsConfig
from moelab.data import ByteTokenizer
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer, save_model
from moelab.models.block_diffusion import to_block_diffusion
from moelab.serve.offload.engine import _ceil2

from ..cli_checks import cli_error

runner = CliRunner()


def _base(hint):
    """``int``/``float`` of ``Annotated[int | None, ...]`` and the like (else the hint)."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


def _numeric_options():
    """``(command, required arguments, flag, type)`` for every int/float option."""
    stack = [("", typer.main.get_command(app))]
    commands = []
    while stack:  # command groups (moelab flow ...) nest their commands
        prefix, group = stack.pop()
        for name, cmd in group.commands.items():
            if isinstance(cmd, typer.core.TyperGroup):
                stack.append((f"{prefix}{name} ", cmd))
            else:
                commands.append((f"{prefix}{name}", cmd))
    for name, cmd in commands:
        hints = typing.get_type_hints(cmd.callback, include_extras=True)
        required = []
        for p in cmd.params:
            if p.required:
                required += ["x"] if isinstance(p, typer.core.TyperArgument) else [p.opts[0], "x"]
        for p in cmd.params:
            kind = _base(hints[p.name])
            if kind in (int, float) and isinstance(p, typer.core.TyperOption):
                yield name, required, p.opts[0], kind


OPTIONS = list(_numeric_options())


def test_every_command_has_its_numeric_options_checked():
    assert len(OPTIONS) > 60 and {c for c, *_ in OPTIONS} >= {
        "serve", "generate", "prune", "quantize", "upcycle", "train", "eval", "compress",
    }  # fmt: skip
    for command, required, flag, kind in OPTIONS:
        bad = "nan" if kind is float else str(2**64 + 1)
        line = cli_error(runner.invoke(app, [*command.split(), *required, flag, bad]))
        assert line.startswith(f"error: {flag}: must be"), (command, line)


@pytest.mark.parametrize(
    "args, words",
    [
        (["serve", "x", "--timeout", "nan"], "--timeout: must be a finite number, got nan"),
        (["serve", "x", "--grace", "-1"], "--grace: must be >= 0, got -1.0"),
        (["serve", "x", "--port", "70000"], "--port: must be in [0, 65535], got 70000"),
        (["prune", "x", "--out", "y", "--alpha", "inf"], "--alpha: must be a finite number"),
        (["prune", "x", "--out", "y", "--seq-len", "0"], "--seq-len: must be >= 1, got 0"),
        (["train", "--expert-parallel", "0"], "--expert-parallel: must be >= 1, got 0"),
        (["generate", "x", "--storage-mbps", "1e-300"], "--storage-mbps: must be >= 0.1"),
        (["generate", "x", "--top-p", "1e-300"], "top_p: 1e-300 is 0 in float32"),
        (["generate", "x", "--seed", "-1"], "--seed: must be in [0, 2**64 - 1], got -1"),
        (["prune", "x", "--out", "y", "--seed", str(2**64)], "--seed: must be in [0, 2**64 - 1]"),
        (["quantize", "x", "--out", "y", "--seed", str(2**70)], "--seed: must be in"),
        (["upcycle", "--from", "x", "--out", "y", "--seed", str(2**64)], "--seed: must be in"),
    ],
)
def test_named_ranges(args, words):
    assert words in cli_error(runner.invoke(app, args))


def test_the_largest_seed_is_accepted():
    # 2**64 - 1 passes the range; the command then fails on its missing run folder
    line = cli_error(runner.invoke(app, ["generate", "nowhere", "--seed", str(2**64 - 1)]))
    assert "nowhere" in line


def test_lora_rank_above_the_expert_widths_is_refused():
    with pytest.raises(InvalidValueError, match=r"lora_rank: must be <= .* = 32, got 33"):
        ExpertsConfig(hidden_size=32, ffn_hidden_size=48, lora_rank=33)
    assert ExpertsConfig(hidden_size=32, ffn_hidden_size=48, lora_rank=32).lora_rank == 32


def test_cache_budget_minimum_is_rounded_up():
    assert _ceil2(0.0123) == 0.02 and _ceil2(1.0) == 1.0 and _ceil2(0.00001) == 0.01


# ------------------------------------------------------------ models a command cannot take
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    r = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat"]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(r.choice(words) for _ in range(80)) for _ in range(20)))
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=256, max_seq_len=64)

    def save(model, name):
        save_model(model.eval(), root / name)
        ByteTokenizer().save(root / name)
        return root / name

    nan = MoETransformer(cfg)
    with torch.no_grad():
        nan.blocks[1].ffn.experts.w_down[2, 0, 0] = float("nan")
    bd = to_block_diffusion(MoETransformer(dataclasses.replace(cfg, vocab_size=257)), 4)
    bd_nan = to_block_diffusion(MoETransformer(dataclasses.replace(cfg, vocab_size=257)), 4)
    with torch.no_grad():
        bd_nan.lm_head.weight.fill_(float("nan"))
    dense_bd = to_block_diffusion(
        MoETransformer(dataclasses.replace(cfg, vocab_size=257, moe=None)), 4
    )
    uneven = MoETransformer(dataclasses.replace(cfg, experts_per_layer=(4, 3)))
    return {
        "corpus": corpus,
        "nan": save(nan, "nan"),
        "bd": save(bd, "bd"),
        "bd_nan": save(bd_nan, "bd_nan"),
        "dense_bd": save(dense_bd, "dense_bd"),
        "uneven": save(uneven, "uneven"),
        "root": root,
    }


CALIB = ["--calib-tokens", "256", "--seq-len", "32", "--batch-size", "4"]


@pytest.mark.parametrize("command", ["prune", "quantize"])
@pytest.mark.parametrize(
    "source, words",
    [
        ("nan", "the weights hold NaN or inf (first in blocks.1.ffn.experts.w_down)"),
        ("bd", "is a block_diffusion model; {command} works on causal models"),
    ],
)
def test_prune_and_quantize_refuse_models_they_cannot_take(folders, tmp_path, command, source,
                                                           words):  # fmt: skip
    out = tmp_path / "out"
    args = [command, str(folders[source]), "--out", str(out), "--calib-data",
            str(folders["corpus"]), *CALIB]  # fmt: skip
    assert words.format(command=command) in cli_error(runner.invoke(app, args))
    assert not out.exists()


def test_prune_refuses_a_quantized_model(folders, tmp_path):
    q = tmp_path / "q"
    common = ["--calib-data", str(folders["corpus"]), *CALIB]
    done = runner.invoke(app, ["quantize", str(folders["uneven"]), "--out", str(q),
                               "--method", "rtn", "--group-size", "16", *common])  # fmt: skip
    assert done.exit_code == 0, done.output
    line = cli_error(runner.invoke(app, ["prune", str(q), "--out", str(tmp_path / "p"), *common]))
    assert "is already quantized; prune the full-precision run" in line


def test_tileq_grid_of_a_model_with_uneven_layers(folders, tmp_path):
    common = [str(folders["uneven"]), "--method", "rtn", "--bits", "2", "--group-size", "16",
              "--calib-data", str(folders["corpus"]), *CALIB]  # fmt: skip
    line = cli_error(runner.invoke(app, ["quantize", *common, "--lowrank", "tileq-core",
                                    "--out", str(tmp_path / "c")]))  # fmt: skip
    assert "the MoE layers have 3, 4 experts; no single grid fits" in line
    done = runner.invoke(app, ["quantize", *common, "--lowrank", "tileq", "--rank", "2",
                               "--out", str(tmp_path / "t")])  # fmt: skip
    assert done.exit_code == 0, done.output
    spec = json.loads((tmp_path / "t" / "quantize.json").read_text())["spec"]
    assert spec["grid"] == [2, 2]  # from the largest layer (4 experts), so it fits both


def test_upcycle_refuses_a_block_diffusion_source(folders, tmp_path):
    line = cli_error(runner.invoke(app, ["upcycle", "--from", str(folders["dense_bd"]),
                                    "--out", str(tmp_path / "u")]))  # fmt: skip
    assert "is a block_diffusion model; upcycling needs a causal one" in line


def test_team_decoder_with_nan_weights_is_one_line(folders):
    line = cli_error(runner.invoke(app, ["generate", str(folders["bd_nan"]), "--decoder", "team",
                                    "--max-new-tokens", "4"]))  # fmt: skip
    assert "logits are not finite" in line
