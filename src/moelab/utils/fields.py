"""Type and range checks of config dataclass fields, from their annotations, run before
any config value is used (so before any allocation).

:func:`check_fields` checks every field of a dataclass instance against its annotation:
``int`` (not ``bool``, not a float such as ``1e23`` or ``256.0``), ``float`` (an int or
float that is finite: ``inf``/``nan`` are refused), ``bool``, ``str``, ``Literal[...]``
members, ``X | None``; other annotations (nested dataclasses, tuples) are left to the
dataclass's own checks. Ints must also lie in ``[-MAX_INT, MAX_INT]`` (no width, count or
seed is larger), so a huge int is refused here rather than overflowing in torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

from moelab.errors import InvalidValueError

MAX_INT = 2**53
"""Largest magnitude accepted for an int field (exactly representable as a float)."""

SEED_MAX = 2**64 - 1
"""Largest seed: ``torch.Generator.manual_seed`` takes 64 bits."""


def check_seed(value: Any, name: str = "seed") -> int:
    """``value`` when it is an int in ``[0, SEED_MAX]`` (what a torch generator can take).

    Raises:
        InvalidValueError: naming ``name``, for a non-int, a negative or a too-large seed.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise InvalidValueError(f"{name}: must be an integer in [0, 2**64 - 1], got {value!r}")
    return value


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_value(name: str, value: Any, hint: Any) -> str | None:
    """An error message for ``value`` against ``hint``, or None when it fits (or is unchecked)."""
    origin = typing.get_origin(hint)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(hint, types.UnionType)):
        args = typing.get_args(hint)
        if value is None:
            return None if type(None) in args else "must not be None"
        errors = [_check_value(name, value, a) for a in args if a is not type(None)]
        if any(e is None for e in errors):
            return None
        return errors[0]
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return None
        return f"must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}"
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {_describe(value)}"
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {_describe(value)}"
        if abs(value) > MAX_INT:
            return f"must be at most {MAX_INT:.3g} in magnitude, got {value}"
        return None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {_describe(value)}"
        if not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        return None
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {_describe(value)}"
    return None


def check_fields(obj: Any, error: type[Exception] = InvalidValueError, prefix: str = "") -> None:
    """Check every field of the dataclass instance ``obj`` against its type annotation.

    Args:
        obj: a dataclass instance (call from ``__post_init__`` before other checks).
        error: exception type to raise.
        prefix: prepended to field names in messages (``"moe.router."``).
    Raises:
        ``error``: ``"<prefix><field>: must be ..., got ..."`` for the first bad field.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        msg = _check_value(f.name, getattr(obj, f.name), hints.get(f.name, Any))
        if msg is not None:
            raise error(f"{prefix}{f.name}: {msg}")
