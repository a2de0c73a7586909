"""The embedded corpus asset and the deterministic, by-document train / held-out split."""

import random

import pytest

from stemlm.data.corpus import Document, embedded_texts, load_embedded_corpus, split_documents
from stemlm.errors import StemlmError


def test_embedded_corpus_contents():
    docs = load_embedded_corpus()
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert sum(d.source == "austen" for d in docs) == 6
    assert sum(d.source == "shakespeare" for d in docs) == 42
    assert "austen/pride_and_prejudice" in names and "shakespeare/hamlet" in names
    emma = next(d for d in docs if d.name == "austen/emma")
    assert emma.text.startswith("EMMA\n") and emma.text.endswith("FINIS\n")
    assert all(d.text.strip() and "\r" not in d.text for d in docs)


def test_default_split_is_disjoint_deterministic_and_mixed():
    docs = load_embedded_corpus()
    train, heldout = split_documents(docs)
    assert {d.name for d in train}.isdisjoint(d.name for d in heldout)
    assert len(train) + len(heldout) == len(docs)
    assert {d.source for d in heldout} == {"austen", "shakespeare"}
    assert 3 <= len(heldout) <= 8
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    assert {d.name for d in split_documents(shuffled)[1]} == {d.name for d in heldout}
    assert {d.name for d in split_documents(docs, seed=1)[1]} != {d.name for d in heldout}


def test_split_rules_on_small_groups():
    docs = [Document(f"doc{i}", "user", "x") for i in range(10)] + [Document("lonely", "other", "y")]
    train, heldout = split_documents(docs, heldout_fraction=0.2, seed=3)
    assert len(heldout) == 2 and all(d.source == "user" for d in heldout)
    assert split_documents(docs, heldout_fraction=0.0)[1] == []
    assert len(split_documents(docs[:2], heldout_fraction=0.9)[0]) == 1  # never all of a group
    with pytest.raises(StemlmError, match="heldout_fraction"):
        split_documents(docs, heldout_fraction=1.0)


def test_embedded_texts_splits():
    train, heldout = embedded_texts("train"), embedded_texts("heldout")
    assert len(train) + len(heldout) == len(embedded_texts("all"))
    assert set(train).isdisjoint(heldout)
    with pytest.raises(StemlmError, match="unknown split"):
        embedded_texts("validation")
