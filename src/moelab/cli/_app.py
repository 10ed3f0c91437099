"""The ``moelab`` Typer app, its consoles, and the one rule for errors.

Every command module registers itself on :data:`app`. A user error (an exception whose type is in
:data:`USER_ERRORS`) prints one red line and exits with code 2; anything else is an internal bug
and keeps its traceback.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from moelab.data import DataError
from moelab.models import CheckpointError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="moelab: train, evaluate, analyse and serve Mixture-of-Experts language models.",
)
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)
Opt = typer.Option

USER_ERRORS = (
    DataError,
    CheckpointError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FloatingPointError,
)


def fail(exc: BaseException) -> None:
    """Print ``exc``'s first line as an error and exit with code 2 (under torchrun every rank
    exits, only rank 0 prints)."""
    if os.environ.get("RANK", "0") == "0":
        err_console.print(
            f"[bold red]error:[/] {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        )
    raise typer.Exit(code=2)


def guarded(fn, *args, **kwargs):
    """Call ``fn``; a user error becomes one red line and exit code 2 (no traceback)."""
    try:
        return fn(*args, **kwargs)
    except USER_ERRORS as exc:
        fail(exc)
    except KeyboardInterrupt:
        err_console.print("[yellow]aborted[/]")
        raise typer.Exit(code=130) from None
