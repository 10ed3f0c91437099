"""`moelab serve` refuses bad settings with one line and exit code 2 (nothing is served)."""

from __future__ import annotations

from typer.testing import CliRunner

from moelab.cli import app
from moelab.data import ByteTokenizer
from moelab.models import save_model

from .live import tiny_byte_model

runner = CliRunner()


def test_bad_serve_settings_exit_2(tmp_path):
    run = tmp_path / "run"
    save_model(tiny_byte_model(), run)
    ByteTokenizer().save(run)
    cases = [
        ([str(tmp_path / "missing")], "not found"),
        ([str(run), "--port", "70000"], "port"),
        ([str(run), "--max-batch", "0"], "--max-batch"),
        ([str(run), "--max-queue", "0"], "--max-queue"),
        ([str(run), "--timeout", "-1"], "timeout"),
        ([str(run), "--max-body-kb", "0"], "--max-body-kb"),
    ]
    for args, word in cases:
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert word in result.output
