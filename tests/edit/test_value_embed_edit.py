"""Edits of a `value_embed` model act on its value rows (a `token` table): a positional edit gives the edited
positions the target's VE rows in every layer reading the table (shared tables included), a global edit writes
them and undoes cleanly, and `stemlm edit` runs on such a checkpoint.

    OMP_NUM_THREADS=1 python -m pytest tests/edit/test_value_embed_edit.py -q
"""

from __future__ import annotations

import json

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.edit.positional import edited_forward, make_edit
from stemlm.edit.spans import entity_ids
from stemlm.edit.table_edits import apply_global_edit, global_edit_hooks, undo

PROMPT = "Country: Spain. Capital:"


def value_model(edit_model):
    model = edit_model("value_embed", num_hidden_layers=3, ffn_layers="all", value_embed_tables=2)
    with torch.no_grad():  # large rows, so an edit of them shows in the logits
        for table in model.token_tables().values():
            table.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return model


def test_positional_edit_swaps_the_value_rows(edit_model, fact_tokenizer):
    model = value_model(edit_model)
    ids = fact_tokenizer.encode(PROMPT).ids
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
    assert edit.layers == (0, 1)  # the two tables, under their owners' indices
    (target,) = fact_tokenizer.encode(" Germany").ids
    x = torch.tensor([ids])
    tables = model.token_tables()
    asked = []

    def value_rows(layer, input_ids):  # independent: VE[t] with the target's row at the edited positions
        asked.append(layer)
        rows = tables[layer].weight[input_ids].clone()
        for p in edit.positions:
            rows[0, p] = tables[layer].weight[target]
        return rows

    with torch.no_grad():
        expected = model(x, rows={"token": value_rows}).logits
        got = edited_forward(model, x, edit).logits
        plain = model(x).logits
    assert asked == [0, 1, 0]  # layer 2 reads table 0
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(got, plain)


def test_global_edit_writes_the_rows_and_undoes(edit_model, fact_tokenizer):
    model = value_model(edit_model)
    x = torch.tensor([fact_tokenizer.encode(PROMPT).ids])
    src, dst = entity_ids(fact_tokenizer, "Spain"), entity_ids(fact_tokenizer, "Germany")
    plan = [tuple(dst)]
    with torch.no_grad():
        plain = model(x).logits
        hooked = model(x, rows=global_edit_hooks(model, src, plan)).logits
        record = apply_global_edit(model, src, plan)
        written = model(x).logits
        undo(record)
        restored = model(x).logits
    torch.testing.assert_close(written, hooked, atol=1e-6, rtol=0)
    assert not torch.allclose(written, plain)
    assert torch.equal(restored, plain)


def test_cli_edit_runs_on_a_value_embed_checkpoint(edit_model, fact_tokenizer, tmp_path, capsys):
    folder = save_pretrained(value_model(edit_model), tmp_path / "ckpt", tokenizer=fact_tokenizer)
    argv = ["edit", str(folder), "--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert "note" not in report and report["before"] != report["after"]
