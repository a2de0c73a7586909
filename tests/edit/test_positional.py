"""Positional edits against an independent plain-tensor forward, with the KV cache, and their guards."""

from __future__ import annotations

import threading

import pytest
import torch

from stemlm.edit.positional import edited_forward, generate_edited, make_edit, positional_edit
from stemlm.errors import StemlmError

PROMPT = "Country: Spain. Capital:"


def _ids(tok, text):
    return tok.encode(text).ids


def _one(tok, name):
    (i,) = tok.encode(" " + name).ids
    return i


def test_plain_forward_matches_reference(edit_model, fact_tokenizer, reference):
    # The oracle itself must agree with the model before it can judge edits.
    model = edit_model()
    ids = torch.tensor(_ids(fact_tokenizer, PROMPT))
    torch.testing.assert_close(model(ids[None]).logits[0], reference(model, ids), atol=1e-5, rtol=1e-5)


def test_positional_edit_equals_reference(edit_model, fact_tokenizer, reference):
    model = edit_model()
    ids = _ids(fact_tokenizer, PROMPT)
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
    pos = ids.index(_one(fact_tokenizer, "Spain"))
    assert edit.positions == (pos,) and edit.layers == (1, 2) and not edit.embed
    rows = {}
    for layer, table in model.token_tables().items():
        r = table.weight.detach()[torch.tensor(ids)].clone()
        r[pos] = table.weight.detach()[_one(fact_tokenizer, "Germany")]
        rows[layer] = r
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    torch.testing.assert_close(got, reference(model, torch.tensor(ids), stem_rows=rows), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, model(torch.tensor([ids])).logits[0], atol=1e-4)


def test_average_and_chosen_layer_equal_reference(edit_model, fact_tokenizer, reference):
    # " Spain" (1 token) takes " United Kingdom" (2 tokens) by averaging, in layer 2 only.
    model = edit_model(seed=3)
    ids = _ids(fact_tokenizer, PROMPT)
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "United Kingdom", strategy="average", layers=[2])
    pos = ids.index(_one(fact_tokenizer, "Spain"))
    target = torch.tensor(fact_tokenizer.encode(" United Kingdom").ids)
    weight = model.token_tables()[2].weight.detach()
    rows = weight[torch.tensor(ids)].clone()
    rows[pos] = (weight[target[0]] + weight[target[1]]) / 2
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    torch.testing.assert_close(got, reference(model, torch.tensor(ids), stem_rows={2: rows}), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad", ["source", "zero", "eot"])
def test_left_pad_rows_equal_reference(edit_model, fact_tokenizer, reference, pad):
    # " United Kingdom" (2 tokens) takes " France" (1 token): the first position is padding.
    model = edit_model(seed=1)
    ids = _ids(fact_tokenizer, "Country: United Kingdom. Capital:")
    edit = make_edit(model, fact_tokenizer, ids, "United Kingdom", "France", strategy="left_pad", pad=pad)
    first, second = edit.positions
    rows = {}
    for layer, table in model.token_tables().items():
        w = table.weight.detach()
        r = w[torch.tensor(ids)].clone()
        r[first] = {"source": w[ids[first]], "zero": torch.zeros_like(w[0]), "eot": w[0]}[pad]
        r[second] = w[_one(fact_tokenizer, "France")]
        rows[layer] = r
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    torch.testing.assert_close(got, reference(model, torch.tensor(ids), stem_rows=rows), atol=1e-5, rtol=1e-5)


def test_embedding_rows_equal_reference_on_dense(edit_model, fact_tokenizer, reference):
    model = edit_model("dense")
    ids = _ids(fact_tokenizer, PROMPT)
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany", rows="embed")
    emb = model.model.embed_tokens.weight.detach()
    rows = emb[torch.tensor(ids)].clone()
    rows[edit.positions[0]] = emb[_one(fact_tokenizer, "Germany")]
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    torch.testing.assert_close(got, reference(model, torch.tensor(ids), embed_rows=rows), atol=1e-5, rtol=1e-5)


def test_both_rows_equal_reference_with_tied_head(edit_model, fact_tokenizer, reference):
    # With tied embeddings the lm_head must still read the unedited matrix.
    model = edit_model(tie_word_embeddings=True)
    ids = _ids(fact_tokenizer, PROMPT)
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Chile", rows="both")
    pos, chile = edit.positions[0], _one(fact_tokenizer, "Chile")
    emb = model.model.embed_tokens.weight.detach()
    erows = emb[torch.tensor(ids)].clone()
    erows[pos] = emb[chile]
    srows = {}
    for layer, table in model.token_tables().items():
        srows[layer] = table.weight.detach()[torch.tensor(ids)].clone()
        srows[layer][pos] = table.weight.detach()[chile]
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    want = reference(model, torch.tensor(ids), stem_rows=srows, embed_rows=erows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_context_manager_matches_function_and_leaves_model_untouched(edit_model, fact_tokenizer):
    model = edit_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([_ids(fact_tokenizer, PROMPT)])
    edit = make_edit(model, fact_tokenizer, ids[0].tolist(), "Spain", "Germany", rows="both")
    with positional_edit(model, edit) as edited:
        inside = edited(ids).logits
    torch.testing.assert_close(inside, edited_forward(model, ids, edit).logits, atol=0, rtol=0)
    torch.testing.assert_close(model(ids).logits, edited_forward(model, ids, None).logits, atol=0, rtol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_concurrent_edits_do_not_interfere(edit_model, fact_tokenizer):
    model = edit_model()
    ids = torch.tensor([_ids(fact_tokenizer, PROMPT)])
    edits = {t: make_edit(model, fact_tokenizer, ids[0].tolist(), "Spain", t) for t in ("Germany", "Chile", "Peru")}
    expected = {t: edited_forward(model, ids, e).logits for t, e in edits.items()}
    got, errors = {}, []

    def run(target):
        try:
            for _ in range(5):
                got[target] = edited_forward(model, ids, edits[target]).logits
        except Exception as exc:  # surfaced below; a thread would otherwise swallow it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in edits]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for t in edits:
        torch.testing.assert_close(got[t], expected[t], atol=0, rtol=0)


@pytest.mark.parametrize("rows", ["tables", "embed", "both"])
def test_kv_cache_generation_equals_full_recompute(edit_model, fact_tokenizer, rows):
    model = edit_model(seed=2)
    prompt = _ids(fact_tokenizer, "The capital of United Kingdom is")
    edit = make_edit(model, fact_tokenizer, prompt, "United Kingdom", "Spain", rows=rows)
    cached = generate_edited(model, prompt, edit, max_new_tokens=8)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(edited_forward(model, torch.tensor([seq]), edit).logits[0, -1].argmax()))
    assert cached == seq[len(prompt) :]


@pytest.mark.parametrize("rows", ["tables", "both"])
def test_edit_persists_in_decode_logits(edit_model, fact_tokenizer, rows):
    # Decode-step logits (cache from an edited prefill, no hooks) equal a full edited recompute and differ
    # from the unedited ones: the edit lives on in the cached keys and values.
    model = edit_model(seed=2)
    prompt = _ids(fact_tokenizer, "The capital of United Kingdom is")
    extra = _ids(fact_tokenizer, " here. Country:")
    edit = make_edit(model, fact_tokenizer, prompt, "United Kingdom", "Spain", rows=rows)
    with torch.no_grad():
        out = edited_forward(model, torch.tensor([prompt]), edit, use_cache=True)
        steps = []
        for token in extra:
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[0, -1])
        full = edited_forward(model, torch.tensor([prompt + extra]), edit).logits[0, len(prompt) :]
        plain = model(torch.tensor([prompt + extra])).logits[0, len(prompt) :]
    torch.testing.assert_close(torch.stack(steps), full, atol=1e-5, rtol=1e-5)
    assert (full - plain).abs().max() > 1e-3


def test_decode_step_with_positional_hook_is_refused(edit_model, fact_tokenizer):
    model = edit_model()
    prompt = _ids(fact_tokenizer, PROMPT)
    edit = make_edit(model, fact_tokenizer, prompt, "Spain", "Germany")
    with pytest.raises(StemlmError, match="without the source tokens"):
        edited_forward(model, torch.tensor([[prompt[-1]]]), edit)


def test_errors(edit_model, fact_tokenizer):
    stem, dense = edit_model(), edit_model("dense")
    prompt = _ids(fact_tokenizer, PROMPT)
    with pytest.raises(StemlmError, match="layer 0 is not a STEM layer"):
        make_edit(stem, fact_tokenizer, prompt, "Spain", "Germany", layers=[0])
    with pytest.raises(StemlmError, match="no STEM tables"):
        make_edit(dense, fact_tokenizer, prompt, "Spain", "Germany")
    with pytest.raises(StemlmError, match="does not occur"):
        make_edit(stem, fact_tokenizer, prompt, "France", "Germany")
    with pytest.raises(StemlmError, match="beyond the model's vocabulary"):
        make_edit(edit_model(vocab_size=300), fact_tokenizer, prompt, "Spain", "Germany")
    with pytest.raises(StemlmError, match="unknown row kind"):
        make_edit(stem, fact_tokenizer, prompt, "Spain", "Germany", rows="bogus")


def test_batch_hooks_equal_separate_edits(edit_model, fact_tokenizer):
    # Rows of different prompts, each with its own edit (or none), scored in one forward.
    from stemlm.edit.positional import batch_hooks

    model = edit_model(seed=6)
    a = _ids(fact_tokenizer, "Country: Spain. Capital:")
    b = _ids(fact_tokenizer, "The capital of United Kingdom is here")
    edits = [
        make_edit(model, fact_tokenizer, a, "Spain", "Peru", rows="both"),
        None,
        make_edit(model, fact_tokenizer, b, "United Kingdom", "Chile", layers=[2]),
    ]
    rows = [a, a, b]
    width = max(map(len, rows))
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    hooks = batch_hooks(model, edits)
    got = model(ids, rows=hooks).logits
    for i, (r, e) in enumerate(zip(rows, edits, strict=True)):
        want = edited_forward(model, torch.tensor([r]), e).logits[0]
        torch.testing.assert_close(got[i, : len(r)], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(StemlmError, match="one per row"):
        model(ids[:2], rows=hooks)


def test_auto_copies_a_shorter_target_equal_to_reference(edit_model, fact_tokenizer, reference):
    # auto with a longer source repeats the target: both " United" and " Kingdom" read " France"'s rows.
    model = edit_model(seed=7)
    ids = _ids(fact_tokenizer, "Country: United Kingdom. Capital:")
    edit = make_edit(model, fact_tokenizer, ids, "United Kingdom", "France")
    rows = {}
    for layer, table in model.token_tables().items():
        w = table.weight.detach()
        rows[layer] = w[torch.tensor(ids)].clone()
        rows[layer][list(edit.positions)] = w[_one(fact_tokenizer, "France")]
    got = edited_forward(model, torch.tensor([ids]), edit).logits[0]
    torch.testing.assert_close(got, reference(model, torch.tensor(ids), stem_rows=rows), atol=1e-5, rtol=1e-5)


def test_embed_rows_hook_shape_is_checked(edit_model):
    model = edit_model()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(StemlmError, match=r"rows\['embed'\] returned shape"):
        model(ids, rows={"embed": lambda input_ids: torch.zeros(1, 3, 7)})
    same = model(ids, rows={"embed": lambda input_ids: model.model.embed_tokens(input_ids)}).logits
    torch.testing.assert_close(same, model(ids).logits, atol=0, rtol=0)
