"""Tests of `stemlm.model.resize.resize_vocabulary`: every kind's vocab-shaped state follows, old rows are kept,
added rows take the kind's init, tied embeddings stay tied, and a model without hashed ids keeps its old logits."""

from __future__ import annotations

import warnings

import pytest
import torch

from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS, ModelConfig
from stemlm.model.kinds.registry import get_kind
from stemlm.model.resize import resize_vocabulary

VOCAB = 64


def tiny(ffn: str, **overrides) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, ffn=ffn, ffn_layers="all-but-first", num_experts=4,
        ple_dim=8, memory_keys=8, memory_topk=4, engram_dim=16, value_embed_tables=1,
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def hashed(ffn: str) -> bool:
    kind = get_kind(ffn)
    return kind.ngram is not None or kind.routes_by_id


@pytest.mark.parametrize("ffn", FFN_KINDS)
@pytest.mark.parametrize("new", [VOCAB + 9, VOCAB - 11])
def test_every_vocab_shaped_tensor_follows(ffn, new):
    model = build_model(tiny(ffn), seed=1).eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if hashed(ffn) else "error")
        resize_vocabulary(model, new)
    assert model.config.vocab_size == new
    assert not any(m.training for m in model.modules())  # rebuilt layers keep the model's eval mode
    assert model.lm_head.weight.shape[0] == model.model.embed_tokens.weight.shape[0] == new
    for table in model.token_tables().values():
        assert table.weight.shape[0] == new
    fresh = build_model(tiny(ffn, vocab_size=new), device="meta")
    shapes = {name: p.shape for name, p in fresh.named_parameters()}
    for name, param in model.named_parameters():
        assert param.shape == shapes[name], name
        keep = min(param.shape[0], before[name].shape[0])
        assert torch.equal(param[:keep], before[name][:keep]), name  # old rows kept
    ids = torch.tensor([[0, new - 1, 3, 5]])
    assert model(ids).logits.shape == (1, 4, new)


@pytest.mark.parametrize("ffn", [k for k in FFN_KINDS if not hashed(k)])
def test_old_tokens_keep_their_logits(ffn):
    model = build_model(tiny(ffn), seed=2).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    resize_vocabulary(model, VOCAB + 20)
    assert torch.equal(model(ids).logits[..., :VOCAB], expected)


def test_added_table_rows_take_the_table_init():
    config = tiny("stem", vocab_size=512, intermediate_size=256, table_init="normal", table_init_std=0.5)
    model = build_model(config, seed=0)
    resize_vocabulary(model, 1024)
    added = model.token_tables()[1].weight[512:]
    assert abs(added.std().item() - 0.5) < 0.02


def test_tied_embeddings_stay_tied():
    model = build_model(tiny("stem", tie_word_embeddings=True), seed=0)
    resize_vocabulary(model, VOCAB + 5)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_hashed_kinds_warn():
    model = build_model(tiny("engram"), seed=0)
    with pytest.warns(UserWarning, match="ffn=engram hashes token ids"):
        resize_vocabulary(model, VOCAB + 5)
