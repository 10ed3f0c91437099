from pathlib import Path

import pytest

from moelab.data.errors import CorpusError, CorpusNotInstalledError
from moelab.data.wordnet import (
    LEXNAMES,
    load_wordnet_hypernyms,
    load_wordnet_supersenses,
    read_synsets,
)
from moelab.errors import InvalidValueError, MissingDependencyError

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"

# A tiny taxonomy in the wndb(5WN) line format:
# entity(0) -> physical_entity(1) -> object(2) -> {dog, cat}(3) -> Rex(4)
#           -> abstraction(1) -> idea(2)
# Rex lists its @i pointer (to idea) before its @ pointer (to dog): the @ one is its first
# hypernym, so Rex belongs under object, not idea.
NOUNS = [
    "00000001 03 n 01 entity 0 000 | that which is perceived or known",
    "00000002 03 n 01 physical_entity 0 001 @ 00000001 n 0000 | an entity that has physical existence",
    "00000003 03 n 02 abstraction 0 abstract_entity 0 001 @ 00000001 n 0000 | a general concept",
    "00000004 03 n 01 object 0 001 @ 00000002 n 0000 | a tangible and visible entity",
    '00000005 05 n 02 dog 0 domestic_dog 0 002 @ 00000004 n 0000 ~ 00000008 n 0000 | a member of the genus Canis; "the dog barked all night"',
    "00000006 05 n 01 cat 0 001 @ 00000004 n 0000 | feline mammal; domestic pet",
    "00000007 09 n 01 idea 0 001 @ 00000003 n 0000 | the content of cognition",
    "00000008 05 n 01 Rex 0 002 @i 00000007 n 0000 @ 00000005 n 0000 | a famous dog",
]  # fmt: skip
OTHER = {
    "verb": [
        "00000020 29 v 01 breathe 0 001 @ 00000021 v 0000 01 + 02 00 | draw air into, and expel out of, the lungs",
        "00000021 30 v 01 change 0 000 01 + 02 00 | undergo a change",
    ],
    "adj": ["00000010 00 a 01 galore(ip) 0 000 | in great numbers"],
    "adv": ["00000030 02 r 01 quickly 0 000 | with speed"],
}  # fmt: skip
INDEX = [
    "idea n 2 1 @ 2 0 00000099 00000007  ",  # idea's second sense
    "object n 1 1 @ 1 0 00000004  ",
    "physical_entity n 1 1 @ 1 0 00000002  ",
    "abstraction n 1 1 @ 1 0 00000003  ",
]


def _wordnet(root: Path, nouns=NOUNS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "data.noun").write_text(HEADER + "\n".join(nouns) + "\n")
    for pos, lines in OTHER.items():
        (root / f"data.{pos}").write_text(HEADER + "\n".join(lines) + "\n")
    (root / "index.noun").write_text(HEADER + "\n".join(INDEX) + "\n")
    return root


def test_read_synsets_parses_fields(tmp_path):
    synsets = read_synsets(_wordnet(tmp_path), ("noun", "adj", "verb"))
    assert len(synsets) == 8 + 1 + 2
    dog = synsets[4]
    assert (dog.offset, dog.pos, dog.lexname) == (5, "n", "noun.animal")
    assert dog.lemmas == ("dog", "domestic_dog") and dog.hypernyms == (4,)
    assert dog.text == "dog: a member of the genus Canis"  # first clause, examples dropped
    assert synsets[7].hypernyms == (5, 7)  # @ before @i, whatever the file order
    assert synsets[2].text == "abstraction: a general concept"
    galore = synsets[8]
    assert galore.lemmas == ("galore",) and galore.lexname == "adj.all"  # marker "(ip)" removed
    assert synsets[1].text == "physical entity: an entity that has physical existence"


def test_supersenses(tmp_path):
    data = load_wordnet_supersenses(_wordnet(tmp_path))
    names = ("adj.all", "adv.all", "noun.Tops", "noun.animal", "noun.cognition")
    assert data.label_names == (*names, "verb.body", "verb.change")  # WordNet's numbering
    assert data.class_counts() == [1, 1, 4, 3, 1, 1, 1]
    assert data.source == "wordnet:supersense"
    assert ("quickly: with speed", 1) in list(data)
    nouns = load_wordnet_supersenses(tmp_path, pos=("noun",), min_count=2)
    assert nouns.label_names == ("noun.Tops", "noun.animal")
    assert len(LEXNAMES) == 45 and LEXNAMES[44] == "adj.ppl"


def test_hypernym_ancestors(tmp_path):
    root = _wordnet(tmp_path)
    depth2 = load_wordnet_hypernyms(root, depth=2, min_synsets=1)
    assert depth2.label_names == ("idea.n.02", "object.n.01")  # sense numbers from index.noun
    # object groups object, dog, cat and Rex (via its @ hypernym dog); idea only itself
    assert depth2.class_counts() == [1, 4]
    assert depth2.texts[depth2.labels.index(1, 1)] == "dog: a member of the genus Canis"
    assert load_wordnet_hypernyms(root, depth=2, min_synsets=2).label_names == ("object.n.01",)
    depth1 = load_wordnet_hypernyms(root, depth=1, min_synsets=1)
    assert dict(zip(depth1.label_names, depth1.class_counts(), strict=True)) == {
        "abstraction.n.01": 2,
        "physical_entity.n.01": 5,
    }
    with pytest.raises(CorpusError, match="no WordNet noun synset lies at depth 9"):
        load_wordnet_hypernyms(root, depth=9, min_synsets=1)
    with pytest.raises(InvalidValueError, match="depth must be an int >= 0"):
        load_wordnet_hypernyms(root, depth=-1)


def test_missing_database_says_how_to_install(tmp_path):
    with pytest.raises(MissingDependencyError) as info:
        load_wordnet_supersenses(tmp_path / "nowhere")
    msg = str(info.value)
    assert isinstance(info.value, CorpusNotInstalledError)
    assert msg.endswith("install it with: apt-get install wordnet-base") and "\n" not in msg
    assert "data.noun" in msg


def test_malformed_files(tmp_path):
    root = _wordnet(tmp_path / "a", [*NOUNS[:3], "00000009 03 n zz entity 0 000 | bad count"])
    with pytest.raises(CorpusError, match=r"data\.noun:5: malformed synset line"):
        read_synsets(root, ("noun",))
    loop = [
        "00000001 03 n 01 a 0 001 @ 00000002 n 0000 | a",
        "00000002 03 n 01 b 0 001 @ 00000001 n 0000 | b",
    ]
    with pytest.raises(CorpusError, match="hypernym cycle"):
        load_wordnet_hypernyms(_wordnet(tmp_path / "b", loop), depth=1, min_synsets=1)
    dangling = ["00000001 03 n 01 a 0 001 @ 00000077 n 0000 | a"]
    with pytest.raises(CorpusError, match="hypernym 00000077 is not a synset"):
        load_wordnet_hypernyms(_wordnet(tmp_path / "c", dangling), depth=0, min_synsets=1)
    with pytest.raises(InvalidValueError, match="pos must be some of"):
        read_synsets(root, ("nouns",))


REAL = Path("/usr/share/wordnet")


@pytest.mark.skipif(
    not (REAL / "data.noun").is_file(),
    reason="WordNet not installed (apt-get install wordnet-base)",
)
def test_real_wordnet_counts():
    senses = load_wordnet_supersenses()
    counts = dict(zip(senses.label_names, senses.class_counts(), strict=True))
    assert len(senses) == 117_659 and len(counts) == 45
    assert min(counts.values()) == counts["noun.motive"] == 42
    hyper = load_wordnet_hypernyms()
    counts = dict(zip(hyper.label_names, hyper.class_counts(), strict=True))
    assert len(counts) == 87 and len(hyper) == 61_227
    assert counts["organism.n.01"] == 19_438 and min(counts.values()) == 101
