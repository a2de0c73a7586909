"""The fact world: asset integrity, template splits, edit records."""

import pytest

from stemlm.data.worlds import facts


def test_countries_load_with_unique_names_and_capitals():
    countries = facts.load_countries()
    assert len(countries) > 200
    names = [c.name for c in countries]
    assert len(set(names)) == len(names)
    assert facts.country("germany").capital == "Berlin"
    assert facts.country("Spain").fact("capital") == "Madrid"


def test_heldout_templates_are_disjoint_from_training_templates():
    train = {p.prompt.replace(p.subject, "{s}") for p in facts.fact_prompts("train")}
    heldout = {p.prompt.replace(p.subject, "{s}") for p in facts.fact_prompts("heldout")}
    assert train and heldout and not train & heldout


def test_no_training_phrasing_of_the_mix_contains_a_heldout_one():
    # The paraphrase test (held-out recall, `stemlm eval edits`' paraphrases moved) is only a test of phrasings the
    # model never read: no training template, the fact mix's extra ones included, holds a held-out template.
    for relation, (train, heldout) in facts.TEMPLATES.items():
        for phrasing in (*train, *facts.MIX_TEMPLATES.get(relation, [])):
            assert not any(h.split("{s}")[0] in phrasing and h.split("{s}")[1] in phrasing for h in heldout)
            assert phrasing not in heldout
    mixed = {p.prompt.replace(p.subject, "{s}") for p in facts.fact_prompts("train", mix=True)}
    assert set(facts.MIX_TEMPLATES["capital"]) <= mixed
    text = "\n".join(facts.fact_documents(repeats=1, seed=3, mix=True))
    assert "Spain has its capital in Madrid." in text
    assert not any(p.prompt in text for p in facts.fact_prompts("heldout"))


def test_documents_contain_every_training_statement_and_no_heldout_prompt():
    docs = facts.fact_documents(repeats=1, seed=3)
    lines = {line for doc in docs for line in doc.split("\n")}
    expected = {p.prompt + p.answer + "." for p in facts.fact_prompts("train")}
    assert lines == expected
    text = "\n".join(docs)
    assert not any(p.prompt in text for p in facts.fact_prompts("heldout"))
    assert facts.fact_documents(repeats=2, seed=1) == facts.fact_documents(repeats=2, seed=1)


def test_edit_records_swap_to_a_different_object():
    records = facts.edit_records("capital", num_records=50, seed=0)
    assert len(records) == 50
    for r in records:
        assert r.subject != r.target_subject
        assert r.true_target != r.new_target
        assert r.new_target == " " + facts.country(r.target_subject).capital
        assert r.subject in r.prompt and all(r.subject in p for p in r.paraphrase_prompts)
        assert all(n.subject != r.subject for n in r.neighborhood)
        train, heldout = facts.TEMPLATES["capital"]
        # Paraphrases are held-out phrasings only; the other training templates are their own prompt set.
        assert r.paraphrase_prompts == [t.format(s=r.subject) for t in heldout]
        assert r.train_prompts == [t.format(s=r.subject) for t in train[1:]]
        target = facts.country(r.target_subject)
        for p in r.portability:  # the subject's other relations, answered as the target country would
            assert p.relation != "capital" and p.new_answer == f" {target.fact(p.relation)}" != p.true_answer
        distinct = {c.capital for c in facts.load_countries()}
        assert r.choices["capital"] == len(distinct)


def test_unknown_relation_and_country_are_clear_errors():
    with pytest.raises(KeyError, match="unknown relation"):
        facts.country("France").fact("anthem")
    with pytest.raises(KeyError, match="no country named"):
        facts.country("Atlantis")
