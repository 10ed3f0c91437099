"""Four-stage reasoning chains in AITZ's CoAT format, one per agent step.

A chain step holds the screen (instruction plus serialised DOM) and the four stages CoME gives
each its own expert [P]: screen summary, subtask plan, action decision and action function.
Target text (``shared/research/wave3-agents-alignment.md`` §3.3, [I])::

    <ss> username empty; password empty; button Login <sp> type the username vina
    <ad> TYPE input username <af> type(ref=7,"vina")

The chains are stored as gzip-compressed JSON lines (one :class:`ChainStep` object a line).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from moelab.errors import InvalidValueError
from moelab.utils.atomic import atomic_write_bytes

STAGES = ("summary", "subtask", "decision", "function")
MARKERS = ("<ss>", "<sp>", "<ad>", "<af>")
ACTION_TYPES = ("CLICK", "TYPE")
SHIPPED = "miniwob_chains.jsonl.gz"

_FUNCTION = re.compile(r'^(click)\(ref=(-?\d+)\)$|^(type)\(ref=(-?\d+),"(.*)"\)$')
_SPLIT = re.compile(r"\s*(<ss>|<sp>|<ad>|<af>)\s*")


@dataclass(frozen=True)
class ChainStep:
    """One oracle step of one episode.

    Attributes:
        task: MiniWoB task name (``"login-user"``). seed: the episode's seed. step: index of
        the step in the episode. utterance: the instruction. dom: the serialised DOM
        (:func:`moelab.methods.agents.dom.serialise_dom`). summary, subtask, decision,
        function: the four stages' text (no markers).
    """

    task: str
    seed: int
    step: int
    utterance: str
    dom: str
    summary: str
    subtask: str
    decision: str
    function: str

    @property
    def stages(self) -> tuple[str, str, str, str]:
        return (self.summary, self.subtask, self.decision, self.function)

    @property
    def prompt(self) -> str:
        return format_prompt(self.utterance, self.dom)

    @property
    def target(self) -> str:
        return format_target(self.stages)


def format_prompt(utterance: str, dom: str) -> str:
    """The model's input: the instruction, the DOM, then a newline before the chain."""
    return f"{utterance}\n{dom}\n"


def format_target(stages: Iterable[str]) -> str:
    """The four stages joined with their markers (``<ss> … <sp> … <ad> … <af> …``).

    Raises:
        ValueError: not exactly four stages, or a stage containing a marker.
    """
    stages = list(stages)
    if len(stages) != len(MARKERS):
        raise InvalidValueError(f"stages: need {len(MARKERS)}, got {len(stages)}")
    for s in stages:
        if _SPLIT.search(s):
            raise InvalidValueError(f"stages: {s!r} contains a stage marker")
    return " ".join(f"{m} {s}" for m, s in zip(MARKERS, stages, strict=True))


def parse_target(text: str) -> dict[str, str]:
    """The stages present in generated chain text, by name (missing stages are absent).

    Text before ``<ss>`` is ignored; a marker that repeats keeps its first occurrence.
    """
    parts = _SPLIT.split(text)
    out: dict[str, str] = {}
    for marker, body in zip(parts[1::2], parts[2::2], strict=True):
        name = STAGES[MARKERS.index(marker)]
        out.setdefault(name, body.strip())
    return out


def parse_function(text: str) -> tuple[str, int, str | None] | None:
    """``("click", ref, None)`` or ``("type", ref, text)`` from an action function; None if
    it does not parse."""
    m = _FUNCTION.match(text.strip())
    if m is None:
        return None
    if m.group(1):
        return ("click", int(m.group(2)), None)
    return ("type", int(m.group(4)), m.group(5))


def action_type(decision: str) -> str:
    """The action type word that opens a decision stage (``""`` when there is none)."""
    word = decision.split(" ", 1)[0] if decision else ""
    return word if word in ACTION_TYPES else ""


def dumps_chains(steps: Iterable[ChainStep]) -> bytes:
    """Gzip-compressed JSON lines (deterministic bytes: the gzip header has no time stamp)."""
    text = "".join(json.dumps(dataclasses.asdict(s), ensure_ascii=False) + "\n" for s in steps)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode("utf-8"))
    return buf.getvalue()


def loads_chains(data: bytes) -> list[ChainStep]:
    """Inverse of :func:`dumps_chains`.

    Raises:
        ValueError: a line is not a chain-step object.
    """
    fields = {f.name for f in dataclasses.fields(ChainStep)}
    out = []
    for i, line in enumerate(gzip.decompress(data).decode("utf-8").splitlines()):
        obj = json.loads(line)
        if not isinstance(obj, dict) or set(obj) != fields:
            raise InvalidValueError(f"chains: line {i + 1} is not a chain step")
        out.append(ChainStep(**obj))
    return out


def write_chains(path: str | os.PathLike[str], steps: Iterable[ChainStep]) -> Path:
    """Write chains to ``path`` (``.jsonl.gz``) atomically."""
    return atomic_write_bytes(path, dumps_chains(steps))


def read_chains(path: str | os.PathLike[str] | None = None) -> list[ChainStep]:
    """Chains from ``path``; None reads the MiniWoB++ set shipped with moelab.

    Raises:
        FileNotFoundError: ``path`` does not exist. ValueError: a malformed line.
    """
    if path is None:
        data = resources.files("moelab.methods.agents").joinpath("data", SHIPPED).read_bytes()
    else:
        data = Path(path).read_bytes()
    return loads_chains(data)
