"""split_documents: deterministic, disjoint, covering, stratified per domain."""

from __future__ import annotations

from collections import Counter

import pytest

from moelab.data import CorpusError, Document, load_corpus, split_documents


def _corpus() -> list[Document]:
    docs = [Document(f"code{i}", "code", f"x = {i}\n") for i in range(40)]
    docs += [Document(f"play{i}", "shakespeare", f"ACT {i}\n") for i in range(5)]
    docs += [Document(f"book{i}", "kjv", f"1:1 verse {i}\n") for i in range(2)]
    return docs


def test_split_is_disjoint_covering_and_ordered() -> None:
    docs = _corpus()
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert not {d.name for d in train} & {d.name for d in val}
    assert sorted(d.name for d in train + val) == sorted(d.name for d in docs)
    order = {d.name: i for i, d in enumerate(docs)}
    assert [order[d.name] for d in train] == sorted(order[d.name] for d in train)
    assert [order[d.name] for d in val] == sorted(order[d.name] for d in val)


def test_split_is_stratified_per_domain() -> None:
    train, val = split_documents(_corpus(), val_fraction=0.1, seed=0)
    # round(40*0.1)=4 code; 5 plays -> round(0.5)=0 -> at least 1; 2 books -> 1 and 1.
    assert Counter(d.domain for d in val) == {"code": 4, "shakespeare": 1, "kjv": 1}
    assert Counter(d.domain for d in train) == {"code": 36, "shakespeare": 4, "kjv": 1}


def test_large_fraction_still_leaves_training_documents() -> None:
    train, val = split_documents(_corpus(), val_fraction=0.99, seed=0)
    assert Counter(d.domain for d in train) == {"code": 1, "shakespeare": 1, "kjv": 1}
    assert len(val) == 39 + 4 + 1


def test_split_is_deterministic_per_seed_and_varies_with_seed() -> None:
    docs = _corpus()
    a = split_documents(docs, val_fraction=0.2, seed=7)
    assert split_documents(list(docs), val_fraction=0.2, seed=7) == a
    vals = {
        tuple(d.name for d in split_documents(docs, val_fraction=0.2, seed=s)[1]) for s in range(5)
    }
    assert len(vals) > 1


def test_split_of_real_corpus_by_seed() -> None:
    docs = load_corpus("shakespeare")
    train, val = split_documents(docs, val_fraction=0.1, seed=0)
    assert len(val) == 4 and len(train) == 38
    assert split_documents(docs, val_fraction=0.1, seed=0)[1] == val


def test_single_document_is_split_by_position_at_a_line_start() -> None:
    text = "".join(f"line {i:03d}\n" for i in range(100))  # 900 characters
    train, val = split_documents([Document("one.txt", "user", text)], val_fraction=0.05)
    assert [d.name for d in train] == ["one.txt#train"]
    assert [d.name for d in val] == ["one.txt#val"]
    assert train[0].text + val[0].text == text
    assert val[0].text.startswith("line ")
    assert 45 <= len(val[0].text) <= 90  # 5% of 900, moved back to a line start
    assert split_documents([Document("one.txt", "user", text)], val_fraction=0.05, seed=9) == (
        train,
        val,
    )


def test_single_document_domain_in_a_larger_corpus_is_split_too() -> None:
    docs = [*_corpus()[:10], Document("solo", "user", "abcdefghij" * 10)]
    train, val = split_documents(docs, val_fraction=0.1)
    assert {d.domain for d in val} == {"code", "user"}
    user_val = next(d for d in val if d.domain == "user")
    assert user_val.text == "abcdefghij"  # no newline: cut at the exact character
    user_train = next(d for d in train if d.domain == "user")
    assert user_train.text == "abcdefghij" * 9


def test_split_errors() -> None:
    with pytest.raises(CorpusError, match="empty corpus"):
        split_documents([])
    with pytest.raises(CorpusError, match="'tiny'"):
        split_documents([Document("tiny", "user", "x")])
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(_corpus(), val_fraction=0.0)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(_corpus(), val_fraction=1.0)
