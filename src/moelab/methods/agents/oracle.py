"""Scripted oracles for eight MiniWoB++ tasks: the plan of one episode, step by step.

Each oracle reads the task's fields (MiniWoB++'s parsed instruction, ``obs["fields"]``) and the
first screen's elements and returns the steps that solve the episode; a step carries the
subtask plan, the action decision and the action function of the four-stage chain (the screen
summary is taken from the screen the step acts on). They solve every seed they were run on
(failures are dropped by the generator, which checks MiniWoB++'s reward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from moelab.errors import InvalidValueError
from moelab.methods.agents.dom import Element, kind, label

TASKS = (
    "click-button",
    "click-link",
    "enter-text",
    "enter-password",
    "login-user",
    "click-checkboxes",
    "click-tab",
    "click-option",
)


@dataclass(frozen=True)
class OracleStep:
    """One planned action.

    Attributes:
        subtask: the plan stage in words. decision: ``"CLICK|TYPE <kind> <name>"``.
        function: ``click(ref=R)`` or ``type(ref=R,"text")``. ref: the element's ref.
        text: the text to type, None for a click.
    """

    subtask: str
    decision: str
    function: str
    ref: int
    text: str | None = None


class OracleError(RuntimeError):
    """The oracle finds no element to act on (an unexpected page)."""


def _find(elements: Sequence[Element], want: str, name: str | None = None) -> Element:
    for el in elements:
        if kind(el) == want and (name is None or label(el, elements) == name):
            return el
    raise OracleError(f"no {want} named {name!r} on the page")


def _click(elements: Sequence[Element], want: str, name: str | None, subtask: str) -> OracleStep:
    el = _find(elements, want, name)
    shown = label(el, elements)
    return OracleStep(subtask, f"CLICK {want} {shown}", f"click(ref={el['ref']})", int(el["ref"]))


def _type(el: Element, elements: Sequence[Element], text: str, subtask: str) -> OracleStep:
    return OracleStep(
        subtask,
        f"TYPE input {label(el, elements)}",
        f'type(ref={el["ref"]},"{text}")',
        int(el["ref"]),
        text,
    )


def _submit(elements: Sequence[Element]) -> OracleStep:
    return _click(elements, "button", None, "submit the form")


def _inputs(elements: Sequence[Element]) -> list[Element]:
    return [el for el in elements if kind(el) == "input"]


def _click_button(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    return [_click(els, "button", f["target"], f"press the {f['target']} button")]


def _click_link(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    return [_click(els, "link", f["target"], f"open the link {f['target']}")]


def _enter_text(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    box = _inputs(els)[0]
    return [_type(box, els, f["target"], f"enter {f['target']} in the field"), _submit(els)]


def _enter_password(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    first, second = _inputs(els)[:2]
    return [
        _type(first, els, f["target"], "enter the password"),
        _type(second, els, f["target"], "repeat the password"),
        _submit(els),
    ]


def _login_user(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    user = next(el for el in _inputs(els) if el["id"] == "username")
    password = next(el for el in _inputs(els) if el["id"] == "password")
    return [
        _type(user, els, f["username"], f"type the username {f['username']}"),
        _type(password, els, f["password"], "type the password"),
        _submit(els),
    ]


def _click_checkboxes(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    names = [v for k, v in f.items() if k.startswith("target")]
    steps = [_click(els, "checkbox", n, f"check {n}") for n in names]
    return [*steps, _submit(els)]


def _click_tab(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    name = f"Tab #{f['target']}"
    return [_click(els, "tab", name, f"switch to tab {f['target']}")]


def _click_option(f: Mapping[str, str], els: Sequence[Element]) -> list[OracleStep]:
    return [_click(els, "radio", f["target"], f"select {f['target']}"), _submit(els)]


_ORACLES: dict[str, Callable[[Mapping[str, str], Sequence[Element]], list[OracleStep]]] = {
    "click-button": _click_button,
    "click-link": _click_link,
    "enter-text": _enter_text,
    "enter-password": _enter_password,
    "login-user": _login_user,
    "click-checkboxes": _click_checkboxes,
    "click-tab": _click_tab,
    "click-option": _click_option,
}


def plan_episode(
    task: str, fields: Sequence[tuple[str, str]], elements: Sequence[Element]
) -> list[OracleStep]:
    """The steps that solve an episode of ``task`` from its first screen.

    Args:
        task: one of :data:`TASKS`. fields: MiniWoB++'s ``(key, value)`` pairs.
        elements: the first screen's DOM elements (see :mod:`moelab.methods.agents.dom`).
    Raises:
        ValueError: an unknown task. OracleError: the page lacks an element the plan needs.
    """
    if task not in _ORACLES:
        raise InvalidValueError(f"task: must be one of {TASKS}, got {task!r}")
    return _ORACLES[task](dict(fields), elements)
