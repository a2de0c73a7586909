"""The synthetic-biography world: people, biographies, QA split, chance levels and edit records."""

from __future__ import annotations

import math
import random

import pytest

from stemlm.data.worlds import bio


def test_people_are_reproducible_distinct_and_drawn_from_the_lists():
    people = bio.make_people(50, seed=3)
    assert people == bio.make_people(50, seed=3) and people != bio.make_people(50, seed=4)
    assert len({p.name for p in people}) == 50
    for p in people:
        assert len(p.name.split()) == 3  # first, middle, last: several tokens under any tokenizer
        assert [a for a, _ in p.attributes] == list(bio.ATTRIBUTES)
        for a, v in p.attributes:
            assert v in bio.attribute_values(a)
    with pytest.raises(ValueError, match="number of people"):
        bio.make_people(1)


def test_attribute_entropy():
    assert bio.attribute_bits("birth_date") == pytest.approx(math.log2(12 * 28 * 50))
    assert bio.attribute_bits("birth_city") == pytest.approx(math.log2(30))
    with pytest.raises(KeyError, match="unknown attribute"):
        bio.attribute_values("shoe_size")


def test_biographies_state_every_attribute_in_varied_orders():
    person = bio.make_people(2, seed=0)[0]
    rng = random.Random(0)
    bios = [bio.biography(person, rng) for _ in range(20)]
    orders = set()
    for text in bios:
        sentences = text.split(". ")
        assert len(sentences) == len(bio.ATTRIBUTES) and all(person.name in s for s in sentences)
        for _, v in person.attributes:
            assert f" {v}." in text
        orders.add(tuple(next(a for a, v in person.attributes if s.rstrip(".").endswith(v)) for s in sentences))
    assert len(orders) > 5  # sentence order is permuted


def test_qa_only_for_the_trained_half_and_heldout_phrasing_never_trained():
    people = bio.make_people(20, seed=1)
    qa_people, held = bio.split_people(people)
    docs = bio.world_documents(people, qa_people, bios_per_person=2, qa_repeats=2, seed=1)
    text = "\n".join(docs)
    assert len(docs) == 20 * 2 + 10 * 2
    for p in held:
        assert f"{p.name}?" not in text  # never asked about
        assert p.name in text  # but their biographies are there
    for p in qa_people:
        assert f"{p.name}?" in text
    for probe in bio.qa_prompts(people, "heldout"):
        assert probe.prompt not in text
    probes = bio.qa_prompts(held, "train")
    assert len(probes) == 10 * sum(len(bio.QA_TEMPLATES[a][0]) for a in bio.ATTRIBUTES)
    assert all(p.answer == f" {next(x for x in held if x.name == p.subject).get(p.relation)}" for p in probes)


def test_memorisation_prompts_are_training_sentence_prefixes():
    people = bio.make_people(6, seed=2)
    docs = "\n".join(bio.world_documents(people, [], bios_per_person=40, qa_repeats=0, seed=2))
    probes = bio.bio_prompts(people)
    assert len(probes) == 6 * sum(len(t) for t in bio.BIO_TEMPLATES.values())
    assert sum(p.prompt + p.answer + "." in docs for p in probes) > 0.9 * len(probes)


def test_chance_is_the_best_name_blind_constant_by_hand():
    people = bio.make_people(40, seed=5)
    train, held = bio.split_people(people)
    got = bio.chance(train, held)
    for a in bio.ATTRIBUTES:
        counts: dict[str, int] = {}
        for p in train:
            counts[p.get(a)] = counts.get(p.get(a), 0) + 1
        best = max(counts.values())
        candidates = [v for v, c in counts.items() if c == best]
        rates = [sum(p.get(a) == v for p in held) / len(held) for v in candidates]
        assert got[a] in rates
    assert got["mean"] == pytest.approx(sum(got[a] for a in bio.ATTRIBUTES) / 5)


def test_edit_records_port_every_other_attribute():
    people = bio.make_people(12, seed=0)
    records = bio.edit_records(people, "birth_city", num_records=5, seed=0)
    by_name = {p.name: p for p in people}
    for r in records:
        source, target = by_name[r.subject], by_name[r.target_subject]
        assert r.true_target == f" {source.get('birth_city')}" != r.new_target
        assert {p.relation for p in r.portability} == {
            a for a in bio.ATTRIBUTES if a != "birth_city" and source.get(a) != target.get(a)
        }
        assert all(p.new_answer == f" {target.get(p.relation)}" for p in r.portability)
        assert r.paraphrase_prompts and all(p.startswith("Question:") for p in r.paraphrase_prompts)
