"""Which words a global edit touches: the changed tokens of a plan and the words that share them."""

from __future__ import annotations

import pytest

from stemlm.data import get_tokenizer
from stemlm.edit.shared_tokens import (
    SharedSubwords,
    changed_token_ids,
    check_shared_subwords,
    describe_shared,
    reference_words,
    shared_words,
)


def test_changed_tokens_skip_kept_rows():
    assert changed_token_ids([5, 6, 7], ((9,), None, ())) == [5, 7]


def test_shared_words_match_a_brute_force_scan():
    tok = get_tokenizer("default")
    sp, ain = tok.token_to_id("ĠSp"), tok.token_to_id("ain")
    words = ["Spain", "Britain", "Spaniard", "again", "Germany", "Port of Spain", "Maine"]
    found = shared_words(tok, [sp, ain], exclude="Spain", words=words)
    for tid in (sp, ain):  # independent oracle: tokenize each word on its own
        expected = [w for w in words if w != "Spain" and tid in tok.encode(" " + w, add_special_tokens=False).ids]
        assert found[tid] == expected
    assert "Britain" in found[ain] and "Spaniard" in found[sp] and "Germany" not in found[sp] + found[ain]


def test_reference_words_cover_the_corpus_and_the_fact_world():
    words = set(reference_words())
    assert {"Britain", "Madrid", "Port of Spain", "Elizabeth"} <= words
    entry = describe_shared(get_tokenizer("default"), [get_tokenizer("default").token_to_id("ain")], "Spain")[0]
    assert entry["token"] == "ain" and "Britain" in entry["shared_with"] and "Spain" not in entry["shared_with"]


def test_check_shared_subwords_refuses_shared_tokens_unless_allowed():
    changed = [
        {"id": 1, "token": "ĠSp", "shared_with": ["Space", "Spake", "Spakest", "Spaniard", "Spanish"]},
        {"id": 2, "token": "x", "shared_with": []},
    ]
    with pytest.raises(
        SharedSubwords, match=r"'ĠSp' also in 5 words \(Space, Spake, Spakest, Spaniard, \.\.\.\); ask"
    ) as e:
        check_shared_subwords({"changed_tokens": changed}, False, "ask")
    assert e.value.changed_tokens == changed and "'x'" not in str(e.value)
    check_shared_subwords({"changed_tokens": changed}, True, "ask")
    check_shared_subwords({"changed_tokens": changed[1:]}, False, "ask")  # nothing shared: nothing to ask
