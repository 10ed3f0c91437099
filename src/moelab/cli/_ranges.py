"""The one check of every numeric CLI option, run before a command's body.

Every ``int`` or ``float`` parameter of every command (``int | None`` and ``float | None``
too) is checked when the command is called, from its annotation:

- a float must be finite (``nan``, ``inf`` refused: no option means anything by them);
- an int must lie within ``±MAX_INT`` unless its range has a maximum (so it cannot
  overflow in torch or C);
- a :class:`Range` in the parameter's ``Annotated[...]`` (next to its ``typer.Option``)
  bounds it further, e.g. ``Annotated[int, Opt(help=...), Range(min=1)]``; :data:`SEED`
  is the range of every seed (64 bits, what a torch generator takes).

So a command states each option's range once, beside its help, and cannot forget the
finiteness or overflow checks. Checks that depend on the model (a rank larger than the
experts) stay with the code that loads it.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moelab.errors import InvalidValueError
from moelab.utils.fields import MAX_INT, SEED_MAX


@dataclass(frozen=True)
class Range:
    """Accepted values of a numeric option: ``min``/``max`` bounds (None = unbounded),
    each inclusive unless ``min_open``/``max_open``."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def describe(self) -> str:
        """``">= 1"``, ``"> 0"``, ``"in (0, 1]"``, ..."""
        if self.min is not None and self.max is not None:
            lo, hi = "(" if self.min_open else "[", ")" if self.max_open else "]"
            return f"in {lo}{_num(self.min)}, {_num(self.max)}{hi}"
        if self.min is not None:
            return f"{'>' if self.min_open else '>='} {_num(self.min)}"
        if self.max is not None:
            return f"{'<' if self.max_open else '<='} {_num(self.max)}"
        return "any number"

    def holds(self, value: float) -> bool:
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return self.max is None or (value < self.max if self.max_open else value <= self.max)


SEED = Range(0, SEED_MAX)
"""The range of every ``--seed``."""


def _num(x: float) -> str:
    return "2**64 - 1" if x == SEED_MAX else f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class _Numeric:
    name: str
    flag: str
    kind: type
    range: Range | None


def numeric_options(fn: Callable) -> list[_Numeric]:
    """The int/float parameters of the command ``fn`` with their flags and ranges."""
    out = []
    hints = typing.get_type_hints(fn, include_extras=True)
    for p in inspect.signature(fn, eval_str=True).parameters.values():
        hint = hints.get(p.name, p.annotation)
        meta: tuple = ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *rest = typing.get_args(hint)
            meta = tuple(rest)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]
        if hint not in (int, float):
            continue
        flag = "--" + p.name.replace("_", "-")
        for m in meta:
            decls = [d for d in getattr(m, "param_decls", None) or () if d.startswith("--")]
            if decls:
                flag = decls[0]
        rng = next((m for m in meta if isinstance(m, Range)), None)
        out.append(_Numeric(p.name, flag, hint, rng))
    return out


def check_numeric(options: list[_Numeric], values: dict[str, Any]) -> None:
    """Check ``values`` (the command's keyword arguments) against ``options``.

    Raises:
        InvalidValueError: ``"--flag: must be ..., got VALUE"`` for the first bad value.
    """
    for opt in options:
        v = values.get(opt.name)
        if v is None or isinstance(v, bool):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidValueError(f"{opt.flag}: must be a finite number, got {v}")
        if opt.range is not None and not opt.range.holds(v):
            raise InvalidValueError(f"{opt.flag}: must be {opt.range.describe()}, got {v}")
        bounded = opt.range is not None and opt.range.max is not None
        if isinstance(v, int) and abs(v) > MAX_INT and not bounded:
            raise InvalidValueError(f"{opt.flag}: must be at most 2**53 in magnitude, got {v}")
