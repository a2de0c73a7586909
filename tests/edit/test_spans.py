"""Entity -> span location and the length-mismatch strategies of `stemlm.edit.spans`."""

from __future__ import annotations

import pytest

from stemlm.edit.spans import align, entity_ids, find_all, locate, tokenizer_eot
from stemlm.errors import StemlmError


def test_entity_ids_spaced_and_bare(fact_tokenizer):
    spaced = entity_ids(fact_tokenizer, "Spain")
    assert fact_tokenizer.decode(spaced) == " Spain" and len(spaced) == 1
    assert fact_tokenizer.decode(entity_ids(fact_tokenizer, " Spain ", spaced=False)) == "Spain"
    assert len(entity_ids(fact_tokenizer, "United Kingdom")) == 2


def test_entity_beyond_vocab_and_empty(fact_tokenizer):
    with pytest.raises(StemlmError, match="beyond the model's vocabulary"):
        entity_ids(fact_tokenizer, "Spain", vocab_size=10)
    with pytest.raises(StemlmError, match="empty entity"):
        entity_ids(fact_tokenizer, "  ")


def test_find_all_non_overlapping():
    assert find_all([1, 2, 1, 2, 1], [1, 2]) == [0, 2]
    assert find_all([1, 1, 1], [1, 1]) == [0]
    assert find_all([3, 4], [5]) == []


def test_locate_every_occurrence_and_bare_start(fact_tokenizer):
    ids = fact_tokenizer.encode("Country: Spain. Capital: Spain's capital").ids
    spans = locate(fact_tokenizer, ids, "Spain")
    assert len(spans) == 2 and all(s.spaced for s in spans)
    for s in spans:
        assert fact_tokenizer.decode(ids[s.start : s.end]) == " Spain"
    start = fact_tokenizer.encode("Spain's capital city").ids
    (span,) = locate(fact_tokenizer, start, "Spain")
    assert not span.spaced and span.start == 0 and fact_tokenizer.decode(start[: span.end]) == "Spain"


def test_locate_missing_source(fact_tokenizer):
    ids = fact_tokenizer.encode("Country: France. Capital:").ids
    with pytest.raises(StemlmError, match="does not occur in the prompt"):
        locate(fact_tokenizer, ids, "Spain")


def test_align_strategies():
    t = [7, 8]
    assert align(2, t, "one_to_one") == ((7,), (8,))
    assert align(4, t, "left_pad", pad="source") == (None, None, (7,), (8,))
    assert align(4, t, "right_pad", pad="source") == ((7,), (8,), None, None)
    assert align(3, t, "left_pad", eot_id=0) == ((0,), (7,), (8,))  # the default pad is the EOT row
    assert align(3, t, "left_pad", pad="zero") == ((), (7,), (8,))
    assert align(3, t, "left_pad", pad="eot", eot_id=0) == ((0,), (7,), (8,))
    assert align(5, t, "copy") == ((7,), (8,), (7,), (8,), (7,))
    assert align(2, [1, 2, 3, 4, 5], "subset") == ((4,), (5,))
    assert align(1, [1, 2, 3], "average") == ((1, 2, 3),)
    assert align(2, [1, 2, 3, 4, 5], "average") == ((1, 2), (3, 4, 5))
    # auto: one_to_one / copy / subset by the length comparison
    assert align(2, t) == align(2, t, "one_to_one")
    assert align(3, t) == align(3, t, "copy") == ((7,), (8,), (7,))
    assert align(1, t) == align(1, t, "subset") == ((8,),)


@pytest.mark.parametrize(
    "source_len,strategy", [(3, "one_to_one"), (1, "left_pad"), (1, "copy"), (3, "subset"), (3, "average")]
)
def test_align_rejects_wrong_direction(source_len, strategy):
    with pytest.raises(StemlmError, match=f"strategy {strategy} needs"):
        align(source_len, [1, 2], strategy)


def test_align_bad_names(fact_tokenizer):
    with pytest.raises(StemlmError, match="unknown strategy"):
        align(1, [1], "bogus")
    with pytest.raises(StemlmError, match="unknown pad row"):
        align(1, [1], pad="bogus")
    with pytest.raises(StemlmError, match="needs a tokenizer"):
        align(2, [1], "left_pad", pad="eot", eot_id=None)
    assert tokenizer_eot(fact_tokenizer) == 0
