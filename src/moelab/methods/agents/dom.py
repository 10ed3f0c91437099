"""Serialise a MiniWoB++ DOM for the model, and describe its interactive elements.

Elements are the dicts of MiniWoB++'s observation space (``ref``, ``parent``, ``tag``,
``text``, ``value``, ``id``, ``classes``, ``flags`` = [focused, tampered, targeted, is_leaf]).
Only leaves are kept (the containers carry no text), at most ``MAX_ELEMENTS`` of them, texts
cut to ``MAX_TEXT`` characters [I]: one line ``[ref] tag "text" id=… value=… focused``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MAX_ELEMENTS = 24
MAX_TEXT = 40

Element = Mapping[str, Any]


def _text(s: str) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 3] + "..."


def _flag(el: Element, i: int) -> bool:
    return bool(int(el["flags"][i]))


def kind(el: Element) -> str | None:
    """The element's interactive kind (button, link, tab, input, checkbox, radio) or None."""
    tag, classes = el["tag"], str(el.get("classes", ""))
    if tag == "button":
        return "button"
    if tag == "span" and "alink" in classes.split():
        return "link"
    if tag == "a" and "ui-tabs-anchor" in classes.split():
        return "tab"
    if tag in ("input_text", "input_password"):
        return "input"
    if tag == "input_checkbox":
        return "checkbox"
    if tag == "input_radio":
        return "radio"
    return None


def label(el: Element, elements: Sequence[Element]) -> str:
    """What a person would call the element: its text, a box's label text, an input's id."""
    k = kind(el)
    if k in ("checkbox", "radio"):
        for other in elements:
            if other["parent"] == el["parent"] and other["tag"] == "t":
                return _text(other["text"])
    if k == "input":
        return str(el["id"]) or "text"
    return _text(el["text"])


def serialise_dom(elements: Sequence[Element]) -> str:
    """One line per leaf element (see the module docstring), joined with newlines."""
    lines = []
    for el in elements:
        if not _flag(el, 3):
            continue
        parts = [f"[{el['ref']}] {el['tag']}"]
        if el["text"]:
            parts.append(f'"{_text(el["text"])}"')
        if el.get("id"):
            parts.append(f"id={el['id']}")
        value = str(el.get("value") or "")
        if value and value != "False":
            parts.append(f'value="{_text(value)}"')
        if _flag(el, 0):
            parts.append("focused")
        lines.append(" ".join(parts))
        if len(lines) == MAX_ELEMENTS:
            break
    return "\n".join(lines)


def summarise(elements: Sequence[Element]) -> str:
    """The screen-summary stage: the interactive elements' kind, name and state, in DOM order
    (``"username empty; password empty; button Login"``) [I]."""
    items = []
    for el in elements:
        k = kind(el)
        if k is None:
            continue
        name = label(el, elements)
        value = str(el.get("value") or "")
        if k == "input":
            items.append(f"{name} {'filled' if value else 'empty'}")
        elif k in ("checkbox", "radio"):
            items.append(f"{k} {name} {'checked' if value == 'True' else 'unchecked'}")
        else:
            items.append(f"{k} {name}")
    return "; ".join(items) if items else "nothing to act on"
