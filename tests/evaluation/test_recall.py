"""Exact greedy recall (stemlm.evaluation.recall): teacher-forced matches equal generation; a random model
recalls almost no fact."""

from __future__ import annotations

from stemlm.data.tokenizer import train_bpe
from stemlm.data.worlds.facts import fact_prompts
from stemlm.evaluation.recall import fact_recall, greedy_matches
from stemlm.inference.generate import generate
from stemlm.model import build_model


def test_greedy_matches_agree_with_generation(tiny_config):
    model = build_model(tiny_config("stem"), seed=1).eval()
    prompts = [[5, 9, 11], [7, 3], [100, 101, 102, 103]]
    pairs = []
    for p in prompts:
        cont = generate(model, p, 3, greedy=True)
        pairs.append((p, cont))
        pairs.append((p, cont[:2] + [(cont[2] + 1) % 256]))  # last token wrong
    assert greedy_matches(model, pairs, batch_size=2) == [True, False] * 3


def test_fact_recall_on_a_model_that_knows_nothing(tiny_config):
    texts = [p.prompt + p.answer for p in fact_prompts("train", ("capital",))]
    tok = train_bpe(texts[:200], vocab_size=400)
    model = build_model(tiny_config("dense", vocab_size=512), seed=0).eval()
    result = fact_recall(model, tok, ("capital",))
    assert result["train"]["prompts"] == len(fact_prompts("train", ("capital",)))
    assert result["heldout"]["prompts"] == len(fact_prompts("heldout", ("capital",)))
    assert result["train"]["recall"] == result["train"]["capital"] < 0.05  # a random model recalls ~nothing


def test_fact_recall_of_a_region_counts_only_its_countries(tiny_config):
    texts = [p.prompt + p.answer for p in fact_prompts("train", ("capital",))]
    tok = train_bpe(texts[:200], vocab_size=400)
    model = build_model(tiny_config("dense", vocab_size=512), seed=0).eval()
    result = fact_recall(model, tok, ("capital",), region=["Spain", "France"])
    assert result["train"]["prompts"] == len(fact_prompts("train", ("capital",), region=["Spain", "France"])) > 0
