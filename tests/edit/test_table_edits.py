"""Global edits and injection: exact rows written, composition, bit-identical undo, hooks, saving."""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.runs import from_pretrained
from stemlm.edit.positional import edited_forward, make_edit
from stemlm.edit.spans import align
from stemlm.edit.table_edits import EDITS_NAME, TableEditor, apply_global_edit, global_edit_hooks, undo
from stemlm.errors import StemlmError


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_identical(model, snap):
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), k


def _one(tok, name):
    (i,) = tok.encode(" " + name).ids
    return i


def test_edit_writes_target_rows_and_undo_restores(edit_model, fact_tokenizer):
    model = edit_model()
    snap = _snapshot(model)
    editor = TableEditor(model, fact_tokenizer)
    editor.edit("Spain", "Germany", layers=[2])
    s, g = _one(fact_tokenizer, "Spain"), _one(fact_tokenizer, "Germany")
    tables = model.token_tables()
    assert torch.equal(tables[2].weight[s], snap["model.layers.2.mlp.stem_embedding.weight"][g])
    assert torch.equal(tables[1].weight[s], snap["model.layers.1.mlp.stem_embedding.weight"][s])  # layer 1 untouched
    editor.undo()
    _assert_identical(model, snap)


def test_edits_compose_and_revert_exactly(edit_model, fact_tokenizer):
    model = edit_model()
    snap = _snapshot(model)
    editor = TableEditor(model, fact_tokenizer)
    editor.edit("Spain", "Germany", rows="both")
    mid = _snapshot(model)
    editor.edit("Germany", "Spain")  # reads Spain's already edited rows (= Germany's): composition, not a swap
    editor.edit("United Kingdom", "France", strategy="left_pad", pad="zero")
    editor.inject("Zorbia", "Chile")
    g = _one(fact_tokenizer, "Germany")  # Germany took Spain's edited rows, i.e. its own original ones
    w = model.token_tables()[1].weight
    assert torch.equal(w[g], snap["model.layers.1.mlp.stem_embedding.weight"][g])
    (uk_first, uk_second) = fact_tokenizer.encode(" United Kingdom").ids[:2]
    assert torch.equal(w[uk_first], torch.zeros_like(w[0]))
    editor.undo()
    editor.undo()
    editor.undo()
    _assert_identical(model, mid)
    editor.undo_all()
    _assert_identical(model, snap)
    with pytest.raises(StemlmError, match="nothing to undo"):
        editor.undo()


def test_swap_in_one_plan_reads_original_rows(edit_model, fact_tokenizer):
    model = edit_model()
    a, b = _one(fact_tokenizer, "Spain"), _one(fact_tokenizer, "Chile")
    w0 = model.token_tables()[1].weight.detach().clone()
    record = apply_global_edit(model, [a, b], ((b,), (a,)))
    w = model.token_tables()[1].weight
    assert torch.equal(w[a], w0[b]) and torch.equal(w[b], w0[a])
    undo(record)
    assert torch.equal(model.token_tables()[1].weight, w0)


def test_global_hooks_equal_in_place_edit(edit_model, fact_tokenizer):
    model = edit_model(seed=4)
    ids = torch.tensor([fact_tokenizer.encode("Country: United Kingdom. Capital: United Kingdom's capital").ids])
    src, tgt = fact_tokenizer.encode(" United Kingdom").ids, fact_tokenizer.encode(" Bosnia and Herzegovina").ids
    plan = align(len(src), tgt, "subset")
    hooks = global_edit_hooks(model, src, plan, rows="both")
    assert set(hooks) == {"token", "embed"}
    hooked = model(ids, rows=hooks).logits
    editor = TableEditor(model, fact_tokenizer)
    editor.edit("United Kingdom", "Bosnia and Herzegovina", strategy="subset", rows="both")
    torch.testing.assert_close(hooked, model(ids).logits, atol=1e-6, rtol=1e-6)


def test_positional_edit_equals_global_edit_on_the_single_occurrence(edit_model, fact_tokenizer):
    model = edit_model(seed=5)
    ids = fact_tokenizer.encode("Country: Spain. Capital:").ids
    positional = edited_forward(model, torch.tensor([ids]), make_edit(model, fact_tokenizer, ids, "Spain", "Peru"))
    TableEditor(model, fact_tokenizer).edit("Spain", "Peru")
    torch.testing.assert_close(positional.logits, model(torch.tensor([ids])).logits, atol=1e-6, rtol=1e-6)


def test_inject_adds_token_and_copies_rows(edit_model, fact_tokenizer):
    tok = fact_tokenizer
    model = edit_model()
    editor = TableEditor(model, tok)
    record = editor.inject("Zorbia", "Chile")
    new_id, chile = record.description["token_id"], _one(tok, "Chile")
    assert record.description["added_to_tokenizer"] and tok.encode("Country: Zorbia.").ids.count(new_id) == 1
    for table in model.token_tables().values():
        assert torch.equal(table.weight[new_id], table.weight[chile])
    assert torch.equal(model.model.embed_tokens.weight[new_id], model.model.embed_tokens.weight[chile])


def test_inject_without_room_is_an_error(edit_model, fact_tokenizer):
    model = edit_model(vocab_size=fact_tokenizer.get_vocab_size())
    with pytest.raises(StemlmError, match="no unused row"):
        TableEditor(model, fact_tokenizer).inject("Zorbia", "Chile")


def test_global_edit_errors(edit_model, fact_tokenizer):
    with pytest.raises(StemlmError, match="no STEM tables"):
        TableEditor(edit_model("dense"), fact_tokenizer).edit("Spain", "Germany")
    with pytest.raises(StemlmError, match="layer 0 is not a STEM layer"):
        TableEditor(edit_model(), fact_tokenizer).edit("Spain", "Germany", layers=[0])
    with pytest.raises(StemlmError, match="repeat a token"):
        apply_global_edit(edit_model(), [5, 5], ((1,), (2,)))


def test_save_writes_loadable_checkpoint_with_edit_log(edit_model, fact_tokenizer, tmp_path):
    model = edit_model()
    editor = TableEditor(model, fact_tokenizer)
    editor.edit("Spain", "Germany")
    editor.save(tmp_path / "edited")
    loaded = from_pretrained(tmp_path / "edited")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    log = json.loads((tmp_path / "edited" / EDITS_NAME).read_text())
    assert [e["kind"] for e in log["edits"]] == ["edit"] and log["edits"][0]["target"] == "Germany"
    assert (tmp_path / "edited" / "tokenizer.json").is_file()
