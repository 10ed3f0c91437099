"""``moelab`` command line: one module per command group, each a thin wrapper that parses
options and calls library functions. Importing this package registers every command on
:data:`app`."""

from moelab.cli import (  # noqa: F401
    agent,
    align,
    analyze,
    compress,
    consolidate,
    continual,
    convert,
    edit,
    eeg,
    evaluate,
    expand,
    flow,
    forecast,
    generate,
    lora,
    prune,
    quantize,
    rl,
    serve,
    train,
    upcycle,
)
from moelab.cli._app import app
from moelab.cli.train import build_configs


def main() -> None:
    app()


__all__ = ["app", "build_configs", "main"]
