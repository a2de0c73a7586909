"""Positional edits of the reference variants' rows (`value_embed_variant="reference"`, `ple_variant="reference"`):
the edited positions get the target's rows in every table, as a row provider that swaps them by hand gives.

    OMP_NUM_THREADS=1 python -m pytest tests/edit/test_reference_variants_edit.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.edit.positional import edited_forward, make_edit

PROMPT = "Country: Spain. Capital:"
VARIANTS = {
    "value_embed": dict(num_hidden_layers=6, ffn_layers="1,2,-3,-2,-1", value_embed_variant="reference"),
    "ple": dict(num_hidden_layers=3, ffn_layers="all", ple_variant="reference"),
}


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_positional_edit_swaps_the_rows(edit_model, fact_tokenizer, kind):
    model = edit_model(kind, **VARIANTS[kind])
    with torch.no_grad():  # large rows, so an edit of them shows in the logits
        for table in model.token_tables().values():
            table.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ids = fact_tokenizer.encode(PROMPT).ids
    edit = make_edit(model, fact_tokenizer, ids, "Spain", "Germany")
    tables = model.token_tables()
    assert edit.layers == tuple(tables)
    (target,) = fact_tokenizer.encode(" Germany").ids
    x = torch.tensor([ids])

    def swapped(layer, input_ids):  # independent: the table's rows with the target's at the edited positions
        rows = tables[layer].weight[input_ids].clone()
        for p in edit.positions:
            rows[0, p] = tables[layer].weight[target]
        return rows

    with torch.no_grad():
        expected = model(x, rows={"token": swapped}).logits
        got = edited_forward(model, x, edit).logits
        plain = model(x).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(got, plain)
