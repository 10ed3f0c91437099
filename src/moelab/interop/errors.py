"""Errors of the Hugging Face converters. All are ``ValueError`` subclasses whose message names
the tensor or config field at fault."""

from __future__ import annotations

from moelab.errors import UserError


class InteropError(UserError, ValueError):
    """A checkpoint cannot be converted; the message says which file, tensor or field."""


class UnsupportedConfigError(InteropError):
    """A config field has a value moelab cannot represent (e.g. sliding-window attention)."""


class ConfigMismatchError(InteropError):
    """config.json and the weights disagree (layer or expert counts, sizes)."""


class MissingTensorError(InteropError):
    """A tensor the config needs is absent from the checkpoint."""


class UnexpectedTensorError(InteropError):
    """The checkpoint holds a tensor the converter has no place for (it would be dropped)."""


class TensorShapeError(ConfigMismatchError):
    """A tensor's shape differs from the one the config implies; names both shapes."""
