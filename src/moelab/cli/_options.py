"""CLI options generated from the config dataclasses: one line per option.

An :class:`ConfigOption` names the flag, the dotted config field it sets and its help; the
flag's type (int, float, str, or an ``--x/--no-x`` bool pair) comes from the dataclass field's
annotation, and ``Literal`` choices are appended to the help. :func:`with_options` turns a
list of them into keyword parameters of a Typer command (all defaulting to None = "not
given", so ``--config`` files and defaults stay in charge).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import typer


@dataclass(frozen=True)
class ConfigOption:
    """One CLI flag that sets one config field.

    Attributes:
        flag: parameter name (``top_k`` is spelled ``--top-k``).
        field: dotted path inside the config root (``moe.router.top_k``).
        help: one-line help; the accepted values of a ``Literal`` field are appended.
    """

    flag: str
    field: str
    help: str


def field_type(root: type, path: str) -> Any:
    """The annotation of the dataclass field at dotted ``path`` below ``root``.

    Raises:
        KeyError: a path component is not a field.
    """
    cls: Any = root
    hint: Any = None
    for part in path.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            raise KeyError(f"{path}: {part!r} is not a field of {cls.__name__}")
        hint = hints[part]
        cls = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)
    return hint


def _cli_type(hint: Any) -> tuple[type, str]:
    """(click-friendly scalar type, help suffix) of a field annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        base = args[0]
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        return type(choices[0]), " One of: " + ", ".join(str(c) for c in choices) + "."
    if base in (bool, int, float, str):
        return base, ""
    raise TypeError(f"no CLI type for the annotation {hint!r}")


def option_parameters(root: type, options: Iterable[ConfigOption]) -> list[inspect.Parameter]:
    """Keyword parameters (``Annotated[T | None, typer.Option(help=...)] = None``)."""
    params = []
    for opt in options:
        typ, suffix = _cli_type(field_type(root, opt.field))
        annotation = Annotated[typ | None, typer.Option(help=opt.help + suffix)]
        params.append(
            inspect.Parameter(opt.flag, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=annotation)
        )  # fmt: skip
    return params


def with_options(fn: Callable, *groups: list[inspect.Parameter]) -> Callable:
    """``fn(**kwargs)`` with its signature extended by ``groups`` (for Typer to read)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = own + [p for group in groups for p in group]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        return fn(**kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__
    return wrapper


def nested(options: Iterable[ConfigOption], values: dict[str, Any]) -> dict[str, Any]:
    """``{flag: value}`` → the nested config dict ``{"moe": {"router": {...}}}`` (None kept,
    meaning "not given"; flags absent from ``values`` are None)."""
    out: dict[str, Any] = {}
    for opt in options:
        *parents, leaf = opt.field.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = values.get(opt.flag)
    return out
