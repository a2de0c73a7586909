"""A model saved and loaded back, by stemlm and by transformers' Auto classes, computes the same logits: the check
every reference variant's tests make (tests/model/test_*_reference.py)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained


def assert_round_trip(model, folder, **config_fields) -> None:
    """Save `model` to `folder`; stemlm's and transformers' loads keep `config_fields` and give bitwise its logits."""
    save_pretrained(model, folder)
    loaded, hf = from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    for name, value in config_fields.items():
        assert getattr(loaded.config, name) == value and getattr(hf.config, name) == value
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(loaded(ids).logits, expected) and torch.equal(hf(ids).logits, expected)
