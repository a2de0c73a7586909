"""The n-gram cache simulation against independent counts: the id stream is the python-integer hashing of
the model tests, and a cache as large as the table misses exactly once per distinct id."""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.offload.ngram_sim import ngram_id_stream, simulate_ngram
from tests.model.test_lookup_kinds import reference_ngram_ids


def small_engram(**extra) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn="engram",
        ffn_layers="1",
        engram_rows=40,
        engram_dim=32,
        **extra,
    )


def test_stream_and_full_cache():
    config = small_engram()
    tokens = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens[100:110] = tokens[0:10]  # a repeated span: its n-grams hit
    stream, keys, rows = ngram_id_stream(config, tokens)
    model = build_model(config, device="meta")
    assert stream == [i for row in reference_ngram_ids(model, tokens) for i in row]
    assert keys == 2 * 4 and rows == model.ngram_hasher.num_rows
    report = simulate_ngram(config, tokens, [1.0, 0.0], ["lfu"])
    full, none = report["results"]
    distinct_per_step = sum(len(set(stream[i : i + keys])) for i in range(0, len(stream), keys))
    assert full["misses"] == len(set(stream)) and full["hits"] == distinct_per_step - len(set(stream))
    assert none["hits"] == 0 and none["lookups"] == len(stream)
    assert simulate_ngram(config.replace(ffn="stem"), tokens, [0.1], ["lfu"]) is None


def test_per_layer_hashing_is_refused_with_one_line():
    with pytest.raises(StemlmError, match="per layer"):
        ngram_id_stream(small_engram(engram_variant="reference"), [1, 2, 3])
