"""Positional edits on a `stem_ngram` model act on the token rows U_l[t] only (the n-gram rows of the edited
positions are those of the original ids), and the CLI says so."""

from __future__ import annotations

import json

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.edit.positional import edited_forward, make_edit
from stemlm.model.kinds.stem_ngram import EDIT_NOTE

PROMPT = "Country: Spain. Capital:"


def ngram_model(edit_model):
    model = edit_model("stem_ngram", stem_ngram_rows=64)
    with torch.no_grad():
        for table in model.tables("ngram").values():
            table.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    return model


def test_edit_swaps_token_rows_and_keeps_ngram_rows(edit_model, fact_tokenizer):
    model = ngram_model(edit_model)
    ids = fact_tokenizer.encode(PROMPT).ids
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
    (target,) = fact_tokenizer.encode(" Germany").ids
    x = torch.tensor([ids])
    tables = model.token_tables()

    def token_rows(layer, input_ids):  # independent: U_l[t] with the target's row at the edited positions
        rows = tables[layer].weight[input_ids].clone()
        for p in edit.positions:
            rows[0, p] = tables[layer].weight[target]
        return rows

    with torch.no_grad():
        expected = model(x, rows={"token": token_rows}).logits
        got = edited_forward(model, x, edit).logits
        plain = model(x).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(got, plain)


def test_cli_says_what_the_edit_acts_on(edit_model, fact_tokenizer, tmp_path, capsys):
    folder = save_pretrained(ngram_model(edit_model), tmp_path / "ckpt", tokenizer=fact_tokenizer)
    argv = ["edit", str(folder), "--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["note"] == EDIT_NOTE
