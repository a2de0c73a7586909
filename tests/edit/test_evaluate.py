"""Edit metrics: scores against per-token forwards, n-gram entropy by hand, and the metrics on a tiny model
trained to know three capitals (an unknown fact shows no efficacy, a leaking edit fails locality)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from stemlm.data.worlds.facts import EditRecord, FactPrompt, PortabilityPrompt
from stemlm.edit.evaluate import evaluate_edits, ngram_entropy, score_continuations
from stemlm.edit.positional import edit_hooks, edited_forward, make_edit
from stemlm.edit.report import LEGEND, format_edit_table
from stemlm.edit.spans import entity_ids
from stemlm.errors import StemlmError

KNOWN = {"Spain": "Madrid", "Germany": "Berlin", "France": "Paris"}


def _record(subject, target, neighbors=("France",), **kw):
    capitals = {**KNOWN, "Chile": "Santiago", "Peru": "Lima", "United Kingdom": "London"}
    return EditRecord(
        subject=subject,
        target_subject=target,
        relation="capital",
        prompt=f"The capital of {subject} is",
        true_target=f" {capitals[subject]}",
        new_target=f" {capitals[target]}",
        train_prompts=[f"Country: {subject}. Capital:"],
        paraphrase_prompts=[f"{subject}'s capital city is"],
        neighborhood=[FactPrompt(n, "capital", f"The capital of {n} is", f" {capitals[n]}") for n in neighbors],
        choices={"capital": 6},
        **kw,
    )


def _records():
    return [_record("Spain", "Germany", ("France", "Chile")), _record("United Kingdom", "France", ("Spain",))]


def _per_token_logprob(model, prompt, cont, edit):
    total, greedy = 0.0, True
    with torch.no_grad():
        for k, token in enumerate(cont):
            logits = edited_forward(model, torch.tensor([prompt + cont[:k]]), edit).logits[0, -1]
            total += float(logits.log_softmax(-1)[token])
            greedy &= int(logits.argmax()) == token
    return total, greedy


@pytest.fixture(scope="module")
def knowing_model(_fact_tokenizer_json):
    """A tiny STEM model trained (a few seconds) on the capitals of Spain, Germany and France only."""
    from tests.conftest import make_tiny_model

    tok = Tokenizer.from_str(_fact_tokenizer_json)
    model = make_tiny_model("stem", seed=0, vocab_size=512).train()
    lines = [
        t.format(s=s, o=o)
        for s, o in KNOWN.items()
        for t in ("The capital of {s} is {o}.", "Country: {s}. Capital: {o}.")
    ]
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(120):
        seqs = [tok.encode(" ".join(rng.sample(lines, len(lines)))).ids for _ in range(8)]
        width = min(len(s) for s in seqs)
        ids = torch.tensor([s[:width] for s in seqs])
        logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


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
    for kind, metrics in result["all_records"].items():
        for name in ("new_greedy", "new_beats_true", "kept_greedy", "own_beats_new", "unchanged"):
            if name in metrics:
                assert metrics[name]["edited"] == pytest.approx(metrics[name]["unedited"], abs=1e-6), (kind, name)
    assert result["fluency"]["edited"] == pytest.approx(result["fluency"]["unedited"])


@pytest.mark.parametrize("mode", ["positional", "global"])
def test_record_metrics_match_independent_scores(edit_model, fact_tokenizer, mode):
    model = edit_model(seed=2)
    with torch.no_grad():  # make rows matter so the comparison is not between two near-identical models
        for table in model.token_tables().values():
            table.weight.mul_(30)
    result = evaluate_edits(model, fact_tokenizer, _records(), mode=mode, details=True, fluency_tokens=0)
    for rec, row in zip(_records(), result["details"], strict=True):
        prompt = fact_tokenizer.encode(rec.prompt).ids
        edit = make_edit(model, fact_tokenizer, prompt, rec.subject, rec.target_subject)
        true, new = fact_tokenizer.encode(rec.true_target).ids, fact_tokenizer.encode(rec.new_target).ids
        lt, gt = _per_token_logprob(model, prompt, true, edit)
        ln, _ = _per_token_logprob(model, prompt, new, edit)
        assert row["margin"] == pytest.approx(ln - lt, abs=1e-4)  # one occurrence: global == positional here
        assert row["erased"] == (not gt)
        _, known = _per_token_logprob(model, prompt, true, None)
        assert row["known"] == known
        knows_moves = []  # the paraphrase test, phrasing by phrasing: answered before, moved after
        for text in rec.paraphrase_prompts:
            ids = fact_tokenizer.encode(text).ids
            _, knows = _per_token_logprob(model, ids, true, None)
            at = make_edit(model, fact_tokenizer, ids, rec.subject, rec.target_subject)
            _, moves = _per_token_logprob(model, ids, new, at)
            knows_moves.append((knows, knows and moves))
        assert row["paraphrases_known"] == sum(k for k, _ in knows_moves)
        assert row["paraphrases_moved"] == sum(m for _, m in knows_moves)
    moved = result["paraphrase_moved"]
    assert moved["known"] == sum(r["paraphrases_known"] for r in result["details"])
    assert moved["moved"] == sum(r["paraphrases_moved"] for r in result["details"])
    assert moved["rate"] == (moved["moved"] / moved["known"] if moved["known"] else None)
    for rec, row in zip(_records(), result["details"], strict=True):  # the name lengths, counted here by hand
        src = len(fact_tokenizer.encode(" " + rec.subject).ids)
        tgt = len(fact_tokenizer.encode(" " + rec.target_subject).ids)
        assert row["lengths"] == {-1: "shorter_target", 0: "equal", 1: "longer_target"}[(tgt > src) - (tgt < src)]
    for group, entry in moved["by_length"].items():
        rows = [r for r in result["details"] if r["lengths"] == group]
        assert rows and entry["known"] == sum(r["paraphrases_known"] for r in rows)
        assert entry["moved"] == sum(r["paraphrases_moved"] for r in rows)
    assert sum(e["known"] for e in moved["by_length"].values()) == moved["known"]
    assert result["records"] == 2
    sets = set(result["all_records"])
    assert sets == (
        {"train", "heldout", "neighborhood"}
        if mode == "global"
        else {"train", "heldout", "locality_other", "locality_same"}
    )


def test_locality_same_subject_by_hand(edit_model, fact_tokenizer):
    """The same subject at an unedited position: scored on the edited sentence's continuation."""
    model = edit_model(seed=3)
    with torch.no_grad():
        for table in model.token_tables().values():
            table.weight.mul_(30)
    rec = _records()[1]
    row = evaluate_edits(model, fact_tokenizer, [rec], details=True, fluency_tokens=0)["details"][0]
    context = fact_tokenizer.encode(f"{rec.prompt}{rec.new_target}.").ids
    ids = context + fact_tokenizer.encode(f" {rec.prompt}").ids
    edit = make_edit(model, fact_tokenizer, context, rec.subject, rec.target_subject)
    assert len(edit.positions) == 2  # "United Kingdom" in the first sentence only
    lt, _ = _per_token_logprob(model, ids, fact_tokenizer.encode(" London").ids, edit)
    ln, _ = _per_token_logprob(model, ids, fact_tokenizer.encode(" Paris").ids, edit)
    assert row["locality_same:own_beats_new"][0] == float(lt > ln)


def test_unknown_fact_shows_no_efficacy_and_is_not_scored(knowing_model, fact_tokenizer):
    known, unknown = _record("Spain", "Germany"), _record("Chile", "Peru")
    result = evaluate_edits(
        knowing_model, fact_tokenizer, [known, unknown], rows="both", details=True, fluency_tokens=0
    )
    by_subject = {r["subject"]: r for r in result["details"]}
    assert by_subject["Spain"]["known"] and not by_subject["Chile"]["known"]
    assert result["known"] == 1 and result["records"] == 2
    # The known fact moves: greedy now gives Berlin on the training templates, never before the edit.
    train = result["sets"]["train"]["new_greedy"]
    assert train["edited"] == 1.0 and train["unedited"] == 0.0 and train["chance"] == pytest.approx(1 / 6)
    # The unknown fact: its greedy new-object rate stays at its unedited value (zero).
    edited, unedited, _ = by_subject["Chile"]["train:new_greedy"]
    assert edited == unedited == 0.0


def test_leaking_positional_edit_fails_locality(knowing_model, fact_tokenizer, monkeypatch):
    import stemlm.edit.evaluate as evaluate

    honest = evaluate_edits(knowing_model, fact_tokenizer, [_record("Spain", "Germany")], rows="both", fluency_tokens=0)
    france, germany = (entity_ids(fact_tokenizer, n) for n in ("France", "Germany"))
    assert len(france) == len(germany) == 1
    real = evaluate.batch_hooks

    def leaky_batch_hooks(model, edits):
        """A faulty edit implementation: besides each row's edit, France reads Germany's rows everywhere."""
        hooks = real(model, edits) or {}
        table_rows, embed_rows = hooks.get("token"), hooks.get("embed")
        tables, embed = model.token_tables(), model.model.embed_tokens

        def leak(rows, ids, weight):
            out = rows.clone()
            out[ids == france[0]] = weight[germany[0]].to(out.dtype)
            return out

        def tables_hook(layer, ids):
            return leak(table_rows(layer, ids) if table_rows else tables[layer](ids), ids, tables[layer].weight)

        def embed_hook(ids):
            return leak(embed_rows(ids) if embed_rows else embed(ids), ids, embed.weight)

        return {"token": tables_hook, "embed": embed_hook}

    monkeypatch.setattr(evaluate, "batch_hooks", leaky_batch_hooks)
    leaking = evaluate_edits(
        knowing_model, fact_tokenizer, [_record("Spain", "Germany")], rows="both", fluency_tokens=0
    )
    for result, kept, unchanged in ((honest, 1.0, 1.0), (leaking, 0.0, 0.0)):
        local = result["sets"]["locality_other"]
        assert local["kept_greedy"]["unedited"] == 1.0  # the model knows Paris after the edited sentence
        assert local["kept_greedy"]["edited"] == kept and local["unchanged"]["edited"] == unchanged
    # The edit itself works in both: only locality tells them apart.
    assert honest["sets"]["train"]["new_greedy"]["edited"] == leaking["sets"]["train"]["new_greedy"]["edited"] == 1


def test_portability_follows_target(knowing_model, fact_tokenizer):
    # Portability probed through another template of the relation the model knows: Spain -> Germany's rows.
    rec = _record(
        "Spain",
        "Germany",
        portability=[PortabilityPrompt("capital2", "Country: Spain. Capital:", " Madrid", " Berlin")],
    )
    rec.choices["capital2"] = 6
    result = evaluate_edits(knowing_model, fact_tokenizer, [rec], rows="both", fluency_tokens=0)
    port = result["sets"]["portability"]
    assert port["n"] == 1 and port["new_greedy"]["edited"] == 1.0 and port["new_greedy"]["unedited"] == 0.0


def test_table_shows_unedited_values_chance_and_legend(knowing_model, fact_tokenizer):
    result = evaluate_edits(knowing_model, fact_tokenizer, [_record("Spain", "Germany")], rows="both", fluency_tokens=4)
    table = format_edit_table({"both": result})
    assert "| both | 1 / 1 | 1.00 (0.00) |" in table
    assert "Chance: train new greedy 0.167" in table
    for term in ("known", "erased", "new greedy", "unchanged", "locality other", "held-out"):
        assert f"- {term}:" in table and term in LEGEND


def test_dense_model_takes_embedding_rows_only(edit_model, fact_tokenizer):
    dense = edit_model("dense")
    result = evaluate_edits(dense, fact_tokenizer, _records(), rows="embed", fluency_tokens=4)
    assert result["rows"] == "embed" and result["known"] == 0 and result["sets"] == {}
    with pytest.raises(StemlmError, match="no STEM tables"):
        evaluate_edits(dense, fact_tokenizer, _records(), rows="tables")
    with pytest.raises(StemlmError, match="unknown edit mode"):
        evaluate_edits(dense, fact_tokenizer, _records(), rows="embed", mode="sideways")


def test_batching_and_cache_do_not_change_results(edit_model, fact_tokenizer):
    model = edit_model(seed=4)
    cache: dict = {}
    first = evaluate_edits(
        model, fact_tokenizer, _records(), rows="tables", fluency_tokens=4, cache=cache, details=True
    )
    filled = len(cache)
    again = evaluate_edits(
        model, fact_tokenizer, _records(), rows="tables", fluency_tokens=4, cache=cache, details=True
    )
    small = evaluate_edits(
        model, fact_tokenizer, _records(), rows="tables", fluency_tokens=4, details=True, batch_rows=3
    )
    assert len(cache) == filled and again == first
    for a, b in zip(first["details"], small["details"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], tuple):
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
