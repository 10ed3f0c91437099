"""Which modules and parameters a list of name patterns selects.

Two kinds of pattern, the same in every adapter function:

- a ``str`` is a name: for modules it matches a module whose dotted name equals it or ends
  with ``"." + pattern`` (PEFT's ``target_modules`` list rule: ``"q_proj"`` matches
  ``blocks.0.attn.q_proj``, ``"attn.q_proj"`` too, ``"proj"`` does not); for parameters it
  matches a parameter whose dotted name contains it as a run of whole components
  (``"router"`` matches ``blocks.0.ffn.router.weight``, ``"lora_A"`` matches
  ``...q_proj.lora_A``, ``"lora"`` matches neither);
- a compiled :class:`re.Pattern` matches a name it ``fullmatch``-es (``re.compile(r".*_proj")``).

PEFT reads a bare string ``target_modules`` as a regex; here ``targets`` must be a list, so
a string is always a name and a regex is always explicit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from moelab.errors import InvalidTypeError

Pattern = str | re.Pattern


def check_patterns(patterns: Sequence[Pattern], what: str) -> list[Pattern]:
    """``patterns`` as a non-empty list of names and compiled regexes.

    Raises:
        InvalidTypeError: a bare string, an empty list, or an entry of another type.
    """
    if isinstance(patterns, (str, re.Pattern)) or not isinstance(patterns, Iterable):
        raise InvalidTypeError(
            f"{what}: expected a list of names or compiled regexes, got {patterns!r} "
            "(wrap a single one in a list)"
        )
    out = list(patterns)
    if not out:
        raise InvalidTypeError(f"{what}: expected at least one name or compiled regex")
    for p in out:
        if not isinstance(p, (str, re.Pattern)) or p == "":
            raise InvalidTypeError(f"{what}: {p!r} is neither a non-empty str nor a re.Pattern")
    return out


def module_matches(pattern: Pattern, name: str) -> bool:
    """Does ``pattern`` select the module called ``name`` (suffix rule above)?"""
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(name) is not None
    return name == pattern or name.endswith("." + pattern)


def parameter_matches(pattern: Pattern, name: str) -> bool:
    """Does ``pattern`` select the parameter called ``name`` (component-run rule above)?"""
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(name) is not None
    return f".{pattern}." in f".{name}."


def describe(pattern: Pattern) -> str:
    """How a pattern reads in an error message."""
    return f"re.compile({pattern.pattern!r})" if isinstance(pattern, re.Pattern) else repr(pattern)
