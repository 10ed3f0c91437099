"""Checks of CLI results shared by the test folders (``from ..cli_checks import cli_error``;
the suite imports with ``--import-mode=importlib``, so ``tests`` acts as a package)."""

from __future__ import annotations

from click.testing import Result


def cli_error(result: Result) -> str:
    """The one ``error:`` line of a refused command run with typer's ``CliRunner``: asserts
    exit code 2, no traceback and a single line, and returns that line."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    text = result.output.strip()
    assert "Traceback" not in text and text.startswith("error:"), text
    assert len(text.splitlines()) == 1, text
    return text
