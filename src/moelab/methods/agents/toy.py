"""A procedural stand-in for MiniWoB++ pages (no browser): the fallback task generator.

It builds first screens of four tasks (click-button, enter-text, login-user,
click-checkboxes) as MiniWoB++-shaped element dicts from a seeded generator, applies the
oracle's actions to them itself (typing fills the input; clicking checks a box), and writes
the same four-stage chains as the browser generator (:mod:`.browser`). Deterministic per seed;
used by the tests and as a quick smoke set.
"""

from __future__ import annotations

import random
from typing import Any

from moelab.errors import InvalidValueError
from moelab.methods.agents.chain import ChainStep
from moelab.methods.agents.dom import serialise_dom, summarise
from moelab.methods.agents.oracle import plan_episode

TOY_TASKS = ("click-button", "enter-text", "login-user", "click-checkboxes")
_WORDS = ("ok", "next", "submit", "cancel", "yes", "no", "previous", "search", "delete", "save")
_NAMES = ("karrie", "vina", "jerald", "marcella", "nathalie", "agustina", "ian", "ruth")


def _el(
    ref: int,
    parent: int,
    tag: str,
    text: str = "",
    id_: str = "",
    classes: str = "",
    leaf: bool = True,
) -> dict[str, Any]:
    return {
        "ref": ref,
        "parent": parent,
        "tag": tag,
        "text": text,
        "value": "",
        "id": id_,
        "classes": classes,
        "flags": [0, 0, 0, int(leaf)],
    }


def _word(rng: random.Random, n: int = 4) -> str:
    return "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n)
    )


def toy_page(task: str, seed: int) -> tuple[str, list[tuple[str, str]], list[dict[str, Any]]]:
    """The first screen of a toy episode: ``(utterance, fields, elements)``.

    Raises:
        ValueError: ``task`` is not one of :data:`TOY_TASKS`.
    """
    rng = random.Random(f"{task}/{seed}")
    if task == "click-button":
        labels = rng.sample(_WORDS, 4)
        target = rng.choice(labels)
        els = [_el(4 + i, 3, "button", w) for i, w in enumerate(labels)]
        return f'Click on the "{target}" button.', [("target", target)], els
    if task == "enter-text":
        target = rng.choice(_NAMES)
        els = [_el(5, 4, "input_text", id_="tt"), _el(6, 4, "button", "Submit", "subbtn")]
        return f'Enter "{target}" into the text field and press Submit.', [("target", target)], els
    if task == "login-user":
        user, password = rng.choice(_NAMES), _word(rng, rng.randint(2, 4))
        els = [
            _el(6, 5, "label", "Username"),
            _el(7, 5, "input_text", id_="username"),
            _el(9, 8, "label", "Password"),
            _el(10, 8, "input_password", id_="password"),
            _el(11, 4, "button", "Login", "subbtn"),
        ]
        utterance = (
            f'Enter the username "{user}" and the password "{password}" into the text fields '
            "and press login."
        )
        return utterance, [("username", user), ("password", password)], els
    if task == "click-checkboxes":
        labels = [_word(rng, rng.randint(2, 6)) for _ in range(rng.randint(2, 4))]
        targets = rng.sample(labels, rng.randint(1, len(labels) - 1))
        els = []
        for i, w in enumerate(labels):
            els += [
                _el(6 + 2 * i, 5 + 2 * i, "input_checkbox", id_=f"ch{i}"),
                _el(-1 - i, 5 + 2 * i, "t", w),
            ]
        els.append(_el(6 + 2 * len(labels), 3, "button", "Submit", "subbtn"))
        fields = [(f"target {i}", t) for i, t in enumerate(targets)] + [("button", "submit")]
        return f"Select {', '.join(targets)} and click Submit.", fields, els
    raise InvalidValueError(f"task: must be one of {TOY_TASKS}, got {task!r}")


def toy_episode(task: str, seed: int) -> list[ChainStep]:
    """The oracle's chain steps on the toy page of ``(task, seed)``."""
    utterance, fields, els = toy_page(task, seed)
    steps = []
    for i, st in enumerate(plan_episode(task, fields, els)):
        steps.append(
            ChainStep(
                task,
                seed,
                i,
                utterance,
                serialise_dom(els),
                summarise(els),
                st.subtask,
                st.decision,
                st.function,
            )
        )
        for el in els:
            el["flags"][0] = int(el["ref"] == st.ref)
            if el["ref"] == st.ref:
                el["value"] = (
                    st.text
                    if st.text is not None
                    else ("True" if el["tag"] == "input_checkbox" else el["value"])
                )
    return steps


def toy_chains(seeds: range | list[int], tasks: tuple[str, ...] = TOY_TASKS) -> list[ChainStep]:
    """Toy chain steps of every (task, seed)."""
    return [s for task in tasks for seed in seeds for s in toy_episode(task, seed)]
