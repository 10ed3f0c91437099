"""The ``moelab`` Typer app, its consoles, and the one rule for errors.

Every command module registers itself on :data:`app`. A user error (a
:class:`moelab.errors.UserError`, or an OS error about a user's path: an exception whose type is
in :data:`USER_ERRORS`) prints one red line and exits with code 2 (every numeric option is
checked by :mod:`moelab.cli._ranges` before a command runs); anything else — a plain
``ValueError`` included — is an internal bug and keeps its traceback. ``moelab --debug ...``
shows the traceback of user errors too and turns on the syncing value checks
(:mod:`moelab.core.checks`).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import typer
from rich.console import Console

from moelab.cli._ranges import check_numeric, numeric_options
from moelab.core import checks
from moelab.errors import DistributedTimeoutError, UserError


class _App(typer.Typer):
    """Typer whose commands check every numeric option first (:mod:`moelab.cli._ranges`)."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def decorator(fn):
            options = numeric_options(fn)

            @functools.wraps(fn)
            def checked(**values):
                guarded(check_numeric, options, values)
                return fn(**values)

            register(checked)
            return fn

        return decorator


app = _App(
    add_completion=False,
    no_args_is_help=True,
    help="moelab: train, evaluate, analyse and serve Mixture-of-Experts language models.",
)


def command_group(name: str, help: str) -> _App:
    """A ``moelab NAME SUBCOMMAND`` group whose commands get the same numeric-option checks."""
    group = _App(no_args_is_help=True, help=help)
    app.add_typer(group, name=name)
    return group


console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)
Opt = typer.Option

USER_ERRORS = (
    UserError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)
_DEBUG = False


@app.callback()
def _main(
    debug: bool = typer.Option(
        False, "--debug", help="Show tracebacks for user errors too; run the NaN/id-range checks."
    ),
) -> None:
    """moelab: train, evaluate, analyse and serve Mixture-of-Experts language models."""
    global _DEBUG
    _DEBUG = debug
    if debug:
        checks.enable(True)
    else:
        checks.reset()


def fail(exc: BaseException) -> None:
    """Print ``exc``'s first line as an error and exit with code 2 (with ``--debug``, raise
    it instead; under torchrun every rank exits, only rank 0 prints, except a
    :class:`DistributedTimeoutError`, which concerns the rank that raises it)."""
    if _DEBUG:
        raise exc
    if os.environ.get("RANK", "0") == "0" or isinstance(exc, DistributedTimeoutError):
        err_console.print(
            f"[bold red]error:[/] {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        )
    raise typer.Exit(code=2)


def guarded(fn, *args, **kwargs):
    """Call ``fn``; a user error becomes one red line and exit code 2 (no traceback)."""
    try:
        return fn(*args, **kwargs)
    except USER_ERRORS as exc:
        if _DEBUG:
            raise
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
