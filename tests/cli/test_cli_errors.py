"""Bad input through the CLI: one clear line on stderr, exit code 2, no traceback, files intact."""

import pytest
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model

from ..cli_checks import cli_error

runner = CliRunner()

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--expert-ffn", "32", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
        "--eval-tokens", "32", "--no-progress"]  # fmt: skip


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256)), folder)
    ByteTokenizer().save(folder)
    return folder


def test_missing_corpus_path(tmp_path):
    assert "nope" in cli_error(
        runner.invoke(
            app, ["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"), *TINY]
        )
    )
    assert not (tmp_path / "r").exists()


def test_empty_binary_and_short_corpora(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cli_error(
        runner.invoke(app, ["train", "--data", str(empty), "--out", str(tmp_path / "r1"), *TINY])
    )
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\x00\x01\x02" * 50)
    assert "bin.txt" in cli_error(
        runner.invoke(app, ["train", "--data", str(binary), "--out", str(tmp_path / "r2"), *TINY])
    )
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    assert "seq_len" in cli_error(
        runner.invoke(app, ["train", "--data", str(short), "--out", str(tmp_path / "r3"), *TINY])
    )


def test_invalid_hyperparameters_name_the_field(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    assert "top_k" in cli_error(
        runner.invoke(
            app, ["train", "--data", str(text), "--out", str(tmp_path / "r"), *TINY, "--top-k", "9"]
        )
    )
    assert "tokenizer" in cli_error(
        runner.invoke(
            app,
            [
                "train",
                "--data",
                str(text),
                "--out",
                str(tmp_path / "r"),
                *TINY,
                "--tokenizer",
                "words",
            ],
        )
    )
    bad = tmp_path / "c.yaml"
    bad.write_text("train: {stepz: 3}\n")
    assert "stepz" in cli_error(
        runner.invoke(app, ["train", "--config", str(bad), "--out", str(tmp_path / "r")])
    )


def test_existing_run_folder_is_not_overwritten(tmp_path, run_dir):
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    assert "not empty" in cli_error(
        runner.invoke(app, ["train", "--data", str(text), "--out", str(run_dir), *TINY])
    )
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_corrupt_truncated_and_newer_run_folders(run_dir):
    weights = run_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert "model.safetensors" in cli_error(
        runner.invoke(app, ["generate", str(run_dir), "--prompt", "hi"])
    )
    weights.write_bytes(data)
    cfg = run_dir / "config.json"
    cfg.write_text(cfg.read_text().replace('"format_version": 1', '"format_version": 99'))
    assert "config.json" in cli_error(runner.invoke(app, ["eval", str(run_dir)]))


def test_missing_run_and_bad_sampling(tmp_path, run_dir):
    assert "not found" in cli_error(
        runner.invoke(app, ["generate", str(tmp_path / "none"), "--prompt", "x"])
    )
    assert "temperature" in cli_error(
        runner.invoke(app, ["generate", str(run_dir), "--temperature", "-1"])
    )
    assert "prompt" in cli_error(runner.invoke(app, ["generate", str(run_dir), "--prompt", ""]))
    # a non-UTF-8 byte reaches Python as a surrogate escape
    bad = b"caf\xff".decode("utf-8", "surrogateescape")
    assert "UTF-8" in cli_error(runner.invoke(app, ["generate", str(run_dir), "--prompt", bad]))
    # checked before the prompt is echoed: nothing but the error on the output
    for flags in (["--top-p", "0"], ["--top-k", "-2"], ["--max-new-tokens", "-3"]):
        cli_error(runner.invoke(app, ["generate", str(run_dir), "--prompt", "ROMEO:", *flags]))


def test_generate_streams_a_deterministic_sample(run_dir):
    a = runner.invoke(
        app, ["generate", str(run_dir), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "3"]
    )
    b = runner.invoke(
        app, ["generate", str(run_dir), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "3"]
    )
    assert a.exit_code == 0 and a.output == b.output and a.output.startswith("ab")


def test_config_file_formats_and_flag_precedence(tmp_path):
    from moelab.cli import build_configs

    none_flags = dict.fromkeys(
        ["d_model", "layers", "heads", "kv_heads", "experts", "top_k", "expert_ffn", "shared_expert",
         "first_dense", "router", "score_func", "capacity_factor", "aux_loss", "aux_coeff", "z_coeff",
         "expert_bias", "bias_rate"]
    )  # fmt: skip
    files = {
        "c.yaml": "model: {d_model: 64, n_heads: 4, moe: {router: {num_experts: 4}}}\ntrain: {steps: 7}\n",
        "c.json": '{"model": {"d_model": 64, "n_heads": 4, "moe": {"router": {"num_experts": 4}}}, "train": {"steps": 7}}',
        "c.toml": "[model]\nd_model = 64\nn_heads = 4\n[model.moe.router]\nnum_experts = 4\n[train]\nsteps = 7\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        model, train = build_configs(path, none_flags, {"lr": 1e-3}, dense=False)
        assert (model.d_model, model.moe.experts.hidden_size, model.moe.router.num_experts) == (
            64,
            64,
            4,
        )
        assert (train.steps, train.lr) == (7, 1e-3)
        model, train = build_configs(path, {**none_flags, "experts": 6}, {"steps": 9}, dense=False)
        assert (model.moe.router.num_experts, train.steps) == (6, 9)
    dense, _ = build_configs(None, none_flags, {}, dense=True)
    assert dense.moe is None


def _none_flags():
    names = ["d_model", "layers", "heads", "kv_heads", "experts", "top_k", "expert_ffn", "shared_expert",
             "first_dense", "router", "score_func", "capacity_factor", "aux_loss", "aux_coeff", "z_coeff",
             "expert_bias", "bias_rate", "usmoe_budget", "usmoe_rate", "usmoe_scope", "usmoe_weight_norm",
             "spec_loss", "spec_coeff", "cross_loss", "cross_coeff", "cross_variant"]  # fmt: skip
    return dict.fromkeys(names)


def test_derived_sizes_follow_the_flags_and_paths_become_absolute(tmp_path, monkeypatch):
    from moelab.cli import build_configs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("x" * 100)
    model, train = build_configs(
        None, {**_none_flags(), "d_model": 64, "heads": 4}, {"data": "t.txt"}, dense=False
    )
    assert model.head_dim == 16 and model.moe.experts.hidden_size == 64
    assert train.data == str(tmp_path / "t.txt")
    model, _ = build_configs(
        None, {**_none_flags(), "d_model": 512, "heads": 8, "first_dense": 1}, {}, dense=False
    )
    assert model.head_dim == 64 and model.dense_ffn_size == 1368
    cfg = tmp_path / "dense.yaml"
    cfg.write_text("model: {moe: null}\ntrain:\n")
    model, _ = build_configs(cfg, _none_flags(), {}, dense=False)
    assert model.moe is None


def test_config_values_of_the_wrong_type_name_the_field(tmp_path):
    for text, field in [
        ("train: {lr: 1e-3}\n", "lr"),
        ("train: {steps: '20'}\n", "steps"),
        ("train: [1, 2]\n", "train"),
    ]:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        assert field in cli_error(
            runner.invoke(app, ["train", "--config", str(path), "--out", str(tmp_path / "r")])
        )
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xaa\xbb\x00")
    assert "b.json" in cli_error(
        runner.invoke(app, ["train", "--config", str(binary), "--out", str(tmp_path / "r")])
    )


def test_out_must_be_a_folder_and_resume_takes_no_settings(tmp_path, run_dir):
    afile = tmp_path / "file.txt"
    afile.write_text("hello world " * 200)
    assert "not a folder" in cli_error(
        runner.invoke(app, ["train", "--data", str(afile), "--out", str(afile), *TINY])
    )
    assert afile.read_text().startswith("hello")
    assert "--steps" in cli_error(
        runner.invoke(app, ["train", "--out", str(run_dir), "--resume", "--steps", "9"])
    )
    (run_dir / "run.json").write_text('{"model": {}, "train": {}}')
    assert "finished" in cli_error(runner.invoke(app, ["train", "--out", str(run_dir), "--resume"]))
    (run_dir / "run.json").write_text("{}")
    assert "run.json" in cli_error(runner.invoke(app, ["eval", str(run_dir)]))


def test_sampling_and_analysis_settings_are_checked(run_dir):
    assert "temperature" in cli_error(
        runner.invoke(app, ["generate", str(run_dir), "--temperature", "nan"])
    )
    assert "--top-p" in cli_error(runner.invoke(app, ["generate", str(run_dir), "--top-p", "1.5"]))
    tiny = runner.invoke(
        app, ["generate", str(run_dir), "--temperature", "1e-45", "--max-new-tokens", "3"]
    )
    assert tiny.exit_code == 0, tiny.output
    assert "--batch-size" in cli_error(
        runner.invoke(app, ["analyze", str(run_dir), "--data", "shakespeare", "--batch-size", "0"])
    )


def test_atomic_writes_follow_the_umask(tmp_path):
    import os

    from moelab.utils.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_decoder_must_fit_the_model(run_dir, tmp_path):
    from moelab.models.block_diffusion import to_block_diffusion

    bd = tmp_path / "bd"
    save_model(to_block_diffusion(MoETransformer(ModelConfig.tiny(vocab_size=256)), 4), bd)
    ByteTokenizer().save(bd)
    for cmd in ("generate", "serve"):
        assert "use --decoder vanilla" in cli_error(runner.invoke(app, [cmd, str(bd)]))
        assert "causal" in cli_error(runner.invoke(app, [cmd, str(run_dir), "--decoder", "team"]))
        assert "decoder" in cli_error(runner.invoke(app, [cmd, str(bd), "--decoder", "fast"]))
        assert "must be causal, vanilla" in cli_error(
            runner.invoke(app, [cmd, str(run_dir), "--decoder", "fast"])
        )
        assert "threshold" in cli_error(
            runner.invoke(app, [cmd, str(bd), "--decoder", "team", "--threshold", "0"])
        )
    team = ["generate", str(bd), "--decoder", "team"]
    for flags, word in (
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "-1"], "temperature"),
    ):
        assert word in cli_error(runner.invoke(app, [*team, *flags])), flags
    ok = runner.invoke(app, ["generate", str(bd), "--decoder", "team", "--max-new-tokens", "8"])
    assert ok.exit_code == 0, ok.output
    assert "NFE" in ok.output and "APT" in ok.output


def test_fit_to_budget_needs_a_time_budget(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    out = tmp_path / "r"
    args = ["train", "--data", str(text), "--out", str(out), *TINY, "--fit-to-budget"]
    assert "--time-budget" in cli_error(runner.invoke(app, args))
    assert not out.exists()


def test_block_size_needs_the_diffusion_objective(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    out = tmp_path / "r"
    args = ["train", "--data", str(text), "--out", str(out), *TINY, "--block-size", "5"]
    assert "--objective block-diffusion" in cli_error(runner.invoke(app, args))
    assert not out.exists()
