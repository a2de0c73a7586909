"""Checks every kind's tests make: a model saved and loaded back, by stemlm and by transformers' Auto classes,
computes the same logits; transformers' `generate` equals a greedy loop of full forwards; the accounting's prefill
and decode FLOPs equal FlopCounterMode's on real forwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.model.accounting import decode_flops_per_token, prefill_flops


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


def assert_hf_generate_is_greedy(model, folder):
    """Save `model`; stemlm's load gives bitwise its logits, and transformers' greedy `generate` the tokens of a loop
    of full forwards without any cache. Returns the transformers model for the caller's own checks."""
    save_pretrained(model, folder)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(folder)(ids).logits, model(ids).logits, atol=0, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    generated = hf.generate(ids, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(generated, seq)
    return hf


def assert_flops_equal_flop_counter(model, monkeypatch, math_attention) -> None:
    """`model`'s accounting prefill (2 × 12 tokens) and decode (the 12th token) FLOPs equal FlopCounterMode's, with
    SDPA replaced by `math_attention` so that attention's matmuls are counted too."""
    cfg = model.config
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == prefill_flops(cfg, 12, 2, "full")
    with torch.no_grad():
        cache = model(ids[:1, :11], use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            model(ids[:1, 11:], past_key_values=cache)
    assert counter.get_total_flops() == decode_flops_per_token(cfg, 12)
