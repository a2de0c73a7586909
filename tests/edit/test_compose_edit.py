"""Edits of a model with STEM layers and value embeddings beside them: a layer's token tables are its STEM table and
its value table, so a positional edit swaps both rows (`--layers` picks layers, not tables), a global edit writes
both and undoes, and `stemlm edit` runs on such a checkpoint and names the tables it touched.

    OMP_NUM_THREADS=1 python -m pytest tests/edit/test_compose_edit.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.edit.positional import edited_forward, make_edit
from stemlm.edit.spans import entity_ids
from stemlm.edit.table_edits import apply_global_edit, undo
from stemlm.errors import StemlmError

PROMPT = "Country: Spain. Capital:"


def composed_model(edit_model):
    """STEM on layers 1 and 3 of four, value embeddings on layers 0, 1 and 3 (keys 8, 9, 11: past the layers)."""
    model = edit_model("stem", num_hidden_layers=4, ffn_layers="odd", value_embed_layers="0,1,-1")
    with torch.no_grad():  # large rows, so an edit of them shows in the logits
        for table in model.token_tables().values():
            table.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return model


def test_positional_edit_swaps_stem_and_value_rows(edit_model, fact_tokenizer):
    model = composed_model(edit_model)
    tables = model.token_tables()
    assert list(tables) == [1, 3, 8, 9, 11]
    ids = fact_tokenizer.encode(PROMPT).ids
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
    assert edit.layers == (1, 3, 8, 9, 11)
    assert make_edit(model, fact_tokenizer, ids, "Spain", "Germany", layers=[1]).layers == (1, 9)
    with pytest.raises(StemlmError, match="layer 2 is not a STEM layer; STEM layers: 0, 1, 3"):
        make_edit(model, fact_tokenizer, ids, "Spain", "Germany", layers=[2])
    (target,) = fact_tokenizer.encode(" Germany").ids
    x = torch.tensor([ids])
    asked = []

    def swapped(key, input_ids):  # independent: every table's row of the target at the edited positions
        asked.append(key)
        rows = tables[key].weight[input_ids].clone()
        for p in edit.positions:
            rows[0, p] = tables[key].weight[target]
        return rows

    with torch.no_grad():
        expected = model(x, rows={"token": swapped}).logits
        got = edited_forward(model, x, edit).logits
        plain = model(x).logits
    assert sorted(set(asked)) == [1, 3, 8, 9, 11]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(got, plain)
    with torch.no_grad():  # the value rows alone change the logits too
        stem_only = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
        stem_only = type(stem_only)(**{**stem_only.__dict__, "layers": (1, 3)})
        assert not torch.allclose(edited_forward(model, x, stem_only).logits, got)


def test_global_edit_writes_both_tables_and_undoes(edit_model, fact_tokenizer):
    model = composed_model(edit_model)
    x = torch.tensor([fact_tokenizer.encode(PROMPT).ids])
    src, dst = entity_ids(fact_tokenizer, "Spain"), entity_ids(fact_tokenizer, "Germany")
    before = {k: t.weight.detach().clone() for k, t in model.token_tables().items()}
    with torch.no_grad():
        plain = model(x).logits
        record = apply_global_edit(model, src, [tuple(dst)], layers=[1])
        for key, table in model.token_tables().items():
            changed = not torch.equal(table.weight[src], before[key][src])
            assert changed == (key in (1, 9)), key  # layer 1's STEM and value rows, nothing else
        assert not torch.allclose(model(x).logits, plain)
        undo(record)
        assert torch.equal(model(x).logits, plain)


def test_cli_edit_runs_on_a_composed_checkpoint(edit_model, fact_tokenizer, tmp_path, capsys):
    folder = save_pretrained(composed_model(edit_model), tmp_path / "ckpt", tokenizer=fact_tokenizer)
    argv = ["edit", str(folder), "--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["before"] != report["after"]
