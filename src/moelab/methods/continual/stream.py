"""Continual-learning streams: a sequence of tasks over one labelled text set.

A :class:`Stream` holds the texts, each text's label in the stream's own numbering (class
``c`` is the ``c``-th class to arrive, so task ``t`` of a B0-Inc\\ *k* stream brings classes
``k·t .. k·t + k - 1``, as PILOT's data manager renumbers them), and per task the indices of
its train and test texts. What a prediction may choose from depends on the scenario
(:meth:`Stream.candidates`):

* ``"class"`` (class-incremental, CaRE's protocol): every class seen so far, no task id;
* ``"task"`` (task-incremental, TRACE-style): the test text's own task's classes;
* ``"domain"`` (domain-incremental, X-TAIL's protocol as ``XTAIL/main.py`` runs it): the joint
  label space of every domain, future ones included, and every task is tested after every
  step (also the not-yet-learned ones).

Builders: :func:`class_incremental_stream` (one labelled set, seeded class order and split;
``scenario="task"`` gives the task-incremental view of the same split) and
:func:`domain_incremental_stream` (one labelled set per domain, their classes concatenated).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from moelab.data.labelled import LabelledText
from moelab.errors import InvalidValueError

Scenario = Literal["class", "task", "domain"]
SCENARIOS = ("class", "task", "domain")


@dataclass(frozen=True)
class Task:
    """One step of a stream.

    Attributes:
        classes: the stream labels this task brings (class/task scenarios) or covers (domain).
        train, test: indices into :attr:`Stream.texts`.
    """

    classes: tuple[int, ...]
    train: tuple[int, ...]
    test: tuple[int, ...]


@dataclass(frozen=True)
class Stream:
    """Texts, their stream labels, class names and the task sequence.

    Attributes:
        texts: every text the stream uses.
        labels: ``labels[i]`` is the stream label of ``texts[i]``, in ``[0, len(class_names))``.
        class_names: ``class_names[c]`` names stream label ``c``.
        tasks: the steps, in order.
        scenario: ``"class"``, ``"task"`` or ``"domain"`` (module docstring).
        source: where the texts come from.
        prompts: ``prompts[c]`` is class ``c``'s label prompt (zero-shot heads), or ``()``
            when the stream has none (:func:`~moelab.methods.continual.domains.domain_stream`
            sets them).
    """

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    class_names: tuple[str, ...]
    tasks: tuple[Task, ...]
    scenario: Scenario
    source: str
    prompts: tuple[str, ...] = ()

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def seen_classes(self, t: int) -> int:
        """Number of classes of tasks ``0..t`` (class/task scenarios: they are ``0..n-1``)."""
        return sum(len(task.classes) for task in self.tasks[: t + 1])

    def candidates(self, t: int, j: int) -> tuple[int, ...]:
        """Labels a prediction on task ``j``'s test texts may choose after training task ``t``."""
        if self.scenario == "task":
            return self.tasks[j].classes
        if self.scenario == "domain":
            return tuple(range(len(self.class_names)))
        return tuple(range(self.seen_classes(t)))

    def tested(self, t: int) -> tuple[int, ...]:
        """The tasks evaluated after training task ``t`` (domain: all; else ``0..t``)."""
        return tuple(range(self.num_tasks if self.scenario == "domain" else t + 1))


def _check_count(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidValueError(f"{name}: must be an int >= 1, got {value!r}")


def _split(indices: list[int], n_train: int, n_test: int, rng: random.Random, name: str):
    if len(indices) < n_train + n_test:
        what = "has no examples" if not indices else f"has {len(indices)} examples"
        raise InvalidValueError(
            f"class {name!r}: {what}, the split needs {n_train} train + {n_test} test"
        )
    order = list(indices)
    rng.shuffle(order)
    return order[:n_train], order[n_train : n_train + n_test]


def class_incremental_stream(
    data: LabelledText,
    *,
    num_tasks: int,
    classes_per_task: int,
    train_per_class: int,
    test_per_class: int,
    seed: int,
    class_order: Sequence[int] | None = None,
    scenario: Literal["class", "task"] = "class",
) -> Stream:
    """A B0-Inc\\ *k* stream: ``num_tasks`` tasks of ``classes_per_task`` classes each.

    The class order is ``class_order`` (class ids of ``data``) or, by default, a permutation
    of all of ``data``'s classes by ``random.Random(seed)``, cut to the first
    ``num_tasks · classes_per_task``. Each class's examples are shuffled by a generator seeded
    with ``(seed, class name)`` and split into ``train_per_class`` train and
    ``test_per_class`` test texts (the rest is unused).

    Raises:
        InvalidValueError: fewer classes than ``num_tasks · classes_per_task``; a class order
            of the wrong length, with an unknown class or repeating one; a used class with no
            (or too few) examples; a count < 1; an unknown scenario.
    """
    for name, v in (
        ("num_tasks", num_tasks),
        ("classes_per_task", classes_per_task),
        ("train_per_class", train_per_class),
        ("test_per_class", test_per_class),
    ):
        _check_count(v, name)
    if scenario not in ("class", "task"):
        raise InvalidValueError(f"scenario: must be 'class' or 'task', got {scenario!r}")
    need = num_tasks * classes_per_task
    n = len(data.label_names)
    if n < need:
        raise InvalidValueError(
            f"{data.source}: {n} classes, fewer than num_tasks x classes_per_task = "
            f"{num_tasks} x {classes_per_task} = {need}"
        )
    if class_order is None:
        order = list(range(n))
        random.Random(seed).shuffle(order)
        order = order[:need]
    else:
        order = list(class_order)
        if len(order) != need:
            raise InvalidValueError(
                f"class_order: {len(order)} classes, expected num_tasks x classes_per_task = {need}"
            )
        seen: set[int] = set()
        for c in order:
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < n:
                raise InvalidValueError(f"class_order: {c!r} is not a class id in [0, {n})")
            if c in seen:
                raise InvalidValueError(
                    f"class_order: class {data.label_names[c]!r} ({c}) appears twice"
                )
            seen.add(c)
    by_class: dict[int, list[int]] = {c: [] for c in order}
    for i, y in enumerate(data.labels):
        if y in by_class:
            by_class[y].append(i)
    texts: list[str] = []
    labels: list[int] = []
    tasks = []
    for t in range(num_tasks):
        classes = order[t * classes_per_task : (t + 1) * classes_per_task]
        train: list[int] = []
        test: list[int] = []
        for c in classes:
            name = data.label_names[c]
            rng = random.Random(f"moelab-stream:{seed}:{name}")
            tr, te = _split(by_class[c], train_per_class, test_per_class, rng, name)
            label = order.index(c)
            for part, idx in ((train, tr), (test, te)):
                for i in idx:
                    part.append(len(texts))
                    texts.append(data.texts[i])
                    labels.append(label)
        first = t * classes_per_task
        tasks.append(Task(tuple(range(first, first + classes_per_task)), tuple(train), tuple(test)))
    names = tuple(data.label_names[c] for c in order)
    return Stream(tuple(texts), tuple(labels), names, tuple(tasks), scenario, data.source)


def domain_incremental_stream(
    domains: Sequence[LabelledText],
    *,
    train_per_class: int,
    test_per_class: int,
    seed: int,
    domain_order: Sequence[int] | None = None,
    scenario: Literal["domain", "task"] = "domain",
) -> Stream:
    """One task per domain, in ``domain_order`` (default: a ``random.Random(seed)``
    permutation); the label space is every domain's classes, numbered domain by domain in
    that order (X-TAIL's joint space, future domains included). Per class the split is as in
    :func:`class_incremental_stream`. ``scenario="task"`` names the task at test (TRACE's
    protocol: prediction among the task's own classes, tasks ``0..t`` tested).

    Raises:
        InvalidValueError: no domains, a bad or repeating domain order, a class with too few
            examples, class names shared by two domains, an unknown scenario.
    """
    if scenario not in ("domain", "task"):
        raise InvalidValueError(f"scenario: must be 'domain' or 'task', got {scenario!r}")
    _check_count(train_per_class, "train_per_class")
    _check_count(test_per_class, "test_per_class")
    if not domains:
        raise InvalidValueError("domains: at least one is needed")
    order = list(range(len(domains)))
    if domain_order is None:
        random.Random(seed).shuffle(order)
    else:
        if sorted(domain_order) != order:
            raise InvalidValueError(
                f"domain_order: must be a permutation of 0..{len(domains) - 1}, got "
                f"{list(domain_order)!r}"
            )
        order = list(domain_order)
    names: list[str] = []
    texts: list[str] = []
    labels: list[int] = []
    tasks = []
    for d in order:
        data = domains[d]
        first = len(names)
        clash = set(names).intersection(data.label_names)
        if clash:
            raise InvalidValueError(f"{data.source}: class {sorted(clash)[0]!r} is in two domains")
        names.extend(data.label_names)
        by_class: dict[int, list[int]] = {c: [] for c in range(len(data.label_names))}
        for i, y in enumerate(data.labels):
            by_class[y].append(i)
        train: list[int] = []
        test: list[int] = []
        for c, name in enumerate(data.label_names):
            rng = random.Random(f"moelab-stream:{seed}:{data.source}:{name}")
            tr, te = _split(by_class[c], train_per_class, test_per_class, rng, name)
            for part, idx in ((train, tr), (test, te)):
                for i in idx:
                    part.append(len(texts))
                    texts.append(data.texts[i])
                    labels.append(first + c)
        tasks.append(Task(tuple(range(first, len(names))), tuple(train), tuple(test)))
    source = "+".join(domains[d].source for d in order)
    return Stream(tuple(texts), tuple(labels), tuple(names), tuple(tasks), scenario, source)
