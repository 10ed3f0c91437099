"""moelab's user-error types: what a user can fix (a bad flag, file, config value or corpus).

The CLI prints one line and exits with code 2 for a :class:`UserError`; every other exception
is a bug in moelab (or in a library it calls) and keeps its traceback. ``moelab --debug``
shows the traceback for user errors too.

The concrete classes also subclass the matching built-in (``ValueError``, ``TypeError``,
``ImportError``), so ``except ValueError`` in existing code keeps working.

This module imports nothing from moelab: every layer (core, models, data, train, interop,
cli) may raise these.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every error the user can fix; the message is one line naming what is wrong."""


class InvalidValueError(UserError, ValueError):
    """A config field, CLI option or argument has a value outside its accepted range; the
    message names the field and the accepted values."""


class InvalidTypeError(UserError, TypeError):
    """A config field or argument has the wrong type; the message names it."""


class MissingDependencyError(UserError, ImportError):
    """An optional package is not installed; the message gives the pip command."""


class TrainingDivergedError(UserError, FloatingPointError):
    """The training loss became NaN/Inf (lower the learning rate, raise warmup or clipping)."""


class DistributedTimeoutError(UserError, TimeoutError):
    """A rank of a distributed run got no answer from another rank within the process-group
    timeout (that rank is stopped, hung or gone). Unlike other user errors it concerns one
    rank, so every rank that raises it reports it, not only rank 0."""


class NonFiniteOutputError(UserError, FloatingPointError):
    """A model's logits or loss are NaN/Inf at evaluation or generation (its weights or
    activations hold NaN/Inf); raised instead of printing ``nan`` or sampling from it."""


__all__ = [
    "DistributedTimeoutError",
    "InvalidTypeError",
    "InvalidValueError",
    "MissingDependencyError",
    "NonFiniteOutputError",
    "TrainingDivergedError",
    "UserError",
]


def require(condition: bool, name: str, what: str) -> None:
    """Raise :class:`InvalidValueError` ``"{name}: {what}"`` unless ``condition`` holds: the
    one-line check of a config field (``name`` the field, ``what`` the accepted values)."""
    if not condition:
        raise InvalidValueError(f"{name}: {what}")
