"""Edit metrics: continuation scoring against per-token forwards, n-gram entropy by hand, record metrics."""

from __future__ import annotations

import math

import pytest
import torch

from stemlm.edit.evaluate import evaluate_edits, ngram_entropy, score_continuations
from stemlm.edit.positional import edit_hooks, edited_forward, make_edit
from stemlm.errors import StemlmError
from stemlm.facts import EditRecord, FactPrompt


def _records():
    return [
        EditRecord(
            subject="Spain",
            target_subject="Germany",
            relation="capital",
            prompt="The capital of Spain is",
            true_target=" Madrid",
            new_target=" Berlin",
            paraphrase_prompts=["Country: Spain. Capital:", "Spain's capital city is"],
            neighborhood=[
                FactPrompt("Chile", "capital", "The capital of Chile is", " Santiago"),
                FactPrompt("Peru", "capital", "The capital of Peru is", " Lima"),
            ],
        ),
        EditRecord(
            subject="United Kingdom",
            target_subject="France",
            relation="capital",
            prompt="The capital of United Kingdom is",
            true_target=" London",
            new_target=" Paris",
            paraphrase_prompts=["Country: United Kingdom. Capital:"],
            neighborhood=[FactPrompt("Spain", "capital", "The capital of Spain is", " Madrid")],
        ),
    ]


def _per_token_logprob(model, prompt, cont, edit):
    total, greedy = 0.0, True
    with torch.no_grad():
        for k, token in enumerate(cont):
            logits = edited_forward(model, torch.tensor([prompt + cont[:k]]), edit).logits[0, -1]
            total += float(logits.log_softmax(-1)[token])
            greedy &= int(logits.argmax()) == token
    return total, greedy


def test_score_continuations_matches_per_token_forwards(edit_model, fact_tokenizer):
    model = edit_model(seed=1)
    prompt = fact_tokenizer.encode("The capital of Spain is").ids
    conts = [fact_tokenizer.encode(" Germany here").ids, fact_tokenizer.encode(" Peru").ids]
    edit = make_edit(model, fact_tokenizer, prompt, "Spain", "Chile", rows="both")
    got = score_continuations(model, prompt, conts, edit_hooks(model, edit))
    for (lp, greedy), cont in zip(got, conts, strict=True):
        want_lp, want_greedy = _per_token_logprob(model, prompt, cont, edit)
        assert lp == pytest.approx(want_lp, abs=1e-4) and greedy == want_greedy


def test_ngram_entropy_by_hand():
    h2 = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))  # bigrams (a b) x2, (b a) x1
    h3 = 1.0  # trigrams (a b a), (b a b)
    assert ngram_entropy("a b a b") == pytest.approx((2 / 3 * h2 + 4 / 3 * h3) / 2)
    assert ngram_entropy("same same same same") == 0.0
    assert ngram_entropy("") == 0.0


def test_identity_edit_changes_nothing(edit_model, fact_tokenizer):
    model = edit_model()
    records = [EditRecord(**{**vars(r), "target_subject": r.subject}) for r in _records()]
    result = evaluate_edits(model, fact_tokenizer, records, fluency_tokens=6)
    for key in ("efficacy", "paraphrase", "neighborhood", "margin", "fluency"):
        assert result[key] == pytest.approx(result[f"unedited_{key}"], abs=1e-6), key


@pytest.mark.parametrize("mode", ["positional", "global"])
def test_record_metrics_match_independent_scores(edit_model, fact_tokenizer, mode):
    model = edit_model(seed=2)
    with torch.no_grad():  # make rows matter so the comparison is not between two near-identical models
        for table in model.stem_tables().values():
            table.weight.mul_(30)
    result = evaluate_edits(model, fact_tokenizer, _records(), mode=mode, details=True, fluency_tokens=0)
    for rec, row in zip(_records(), result["details"], strict=True):
        prompt = fact_tokenizer.encode(rec.prompt).ids
        edit = make_edit(model, fact_tokenizer, prompt, rec.subject, rec.target_subject)
        lt, gt = _per_token_logprob(model, prompt, fact_tokenizer.encode(rec.true_target).ids, edit)
        ln, _ = _per_token_logprob(model, prompt, fact_tokenizer.encode(rec.new_target).ids, edit)
        assert row["margin"] == pytest.approx(ln - lt, abs=1e-4)  # one occurrence: global == positional here
        assert row["efficacy"] == float(ln > lt) and row["erased"] == (not gt)
    assert result["records"] == 2 and result["efficacy"] == pytest.approx(
        sum(r["efficacy"] for r in result["details"]) / 2
    )


def test_positional_neighborhood_is_in_context(edit_model, fact_tokenizer):
    model = edit_model(seed=3)
    rec = _records()[1]
    row = evaluate_edits(model, fact_tokenizer, [rec], details=True, fluency_tokens=0)["details"][0]
    context = fact_tokenizer.encode(f"{rec.prompt}{rec.new_target}.").ids
    ids = context + fact_tokenizer.encode(" The capital of Spain is").ids
    edit = make_edit(model, fact_tokenizer, context, rec.subject, rec.target_subject)
    lt, _ = _per_token_logprob(model, ids, fact_tokenizer.encode(" Madrid").ids, edit)
    ln, _ = _per_token_logprob(model, ids, fact_tokenizer.encode(" Paris").ids, edit)
    assert row["neighborhood"] == float(lt > ln)


def test_dense_model_takes_embedding_rows_only(edit_model, fact_tokenizer):
    dense = edit_model("dense")
    result = evaluate_edits(dense, fact_tokenizer, _records(), rows="embed", fluency_tokens=4)
    assert result["rows"] == "embed" and 0.0 <= result["efficacy"] <= 1.0
    with pytest.raises(StemlmError, match="no STEM tables"):
        evaluate_edits(dense, fact_tokenizer, _records(), rows="stem")
    with pytest.raises(StemlmError, match="unknown edit mode"):
        evaluate_edits(dense, fact_tokenizer, _records(), rows="embed", mode="sideways")


def test_cache_reuses_unedited_results_without_changing_them(edit_model, fact_tokenizer):
    model = edit_model(seed=4)
    cache: dict = {}
    first = evaluate_edits(model, fact_tokenizer, _records(), rows="stem", fluency_tokens=4, cache=cache, details=True)
    filled = len(cache)
    again = evaluate_edits(model, fact_tokenizer, _records(), rows="embed", fluency_tokens=4, cache=cache, details=True)
    plain = evaluate_edits(model, fact_tokenizer, _records(), rows="embed", fluency_tokens=4, details=True)
    assert filled == len(cache) == 4  # scores + generation per record, computed once
    assert again == plain and first["unedited_efficacy"] == again["unedited_efficacy"]
