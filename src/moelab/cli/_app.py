"""The ``moelab`` Typer app, its consoles, and the one rule for errors.

Every command module registers itself on :data:`app`. A user error (an exception whose type is in
:data:`USER_ERRORS`) prints one red line and exits with code 2; anything else is an internal bug
and keeps its traceback.
"""

from __future__ import annotations

import re
import sys

import typer
from rich.console import Console

from moelab.data import DataError
from moelab.models import CheckpointError
from moelab.utils.atomic import DiskFullError

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
    DiskFullError,
)


def fail(exc: BaseException) -> None:
    """Print ``exc``'s first line as an error and exit with code 2."""
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
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        fail(MemoryError(f"out of memory: {_oom_detail(exc)}; use a smaller model or batch"))
    except KeyboardInterrupt:
        err_console.print("[yellow]aborted[/]")
        raise typer.Exit(code=130) from None


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failure (Python's MemoryError, torch's CPU/GPU out-of-memory errors)."""
    text = str(exc)
    return (
        isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text
    )


def _oom_detail(exc: BaseException) -> str:
    """``"tried to allocate N bytes"`` from torch's message, else the error's first line."""
    m = re.search(r"tried to allocate (\d+) bytes", str(exc))
    if m:
        return f"tried to allocate {int(m.group(1)):,} bytes"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
