"""The n-gram cache simulation against independent counts: the id stream is the python-integer hashing of
the model tests, and a cache as large as the table misses exactly once per distinct id."""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.offload.ngram_sim import ngram_id_streams, simulate_ngram
from tests.model.test_engram_reference import demo_hash_ids
from tests.model.test_lookup_kinds import reference_ngram_ids


def small_engram(**extra) -> ModelConfig:
    shape = dict(vocab_size=64, num_hidden_layers=2, ffn_layers="1") | extra
    return ModelConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        ffn="engram",
        engram_rows=40,
        engram_dim=32,
        **shape,
    )


def test_stream_and_full_cache():
    config = small_engram()
    tokens = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens[100:110] = tokens[0:10]  # a repeated span: its n-grams hit
    streams, keys = ngram_id_streams(config, tokens)
    ((stream, rows),) = streams.values()
    model = build_model(config, device="meta")
    assert stream == [i for row in reference_ngram_ids(model, tokens) for i in row]
    assert keys == 2 * 4 and rows == model.ngram_hasher.num_rows
    report = simulate_ngram(config, tokens, [1.0, 0.0], ["lfu"])
    full, none = report["results"]
    distinct_per_step = sum(len(set(stream[i : i + keys])) for i in range(0, len(stream), keys))
    assert full["misses"] == len(set(stream)) and full["hits"] == distinct_per_step - len(set(stream))
    assert none["hits"] == 0 and none["lookups"] == len(stream)
    assert simulate_ngram(config.replace(ffn="stem"), tokens, [0.1], ["lfu"]) is None


def test_per_layer_hashing_replays_a_cache_per_layer():
    config = small_engram(engram_variant="reference", num_hidden_layers=3, ffn_layers="0,2", hash_seed=5)
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens[100:110] = tokens[0:10]
    streams, keys = ngram_id_streams(config, tokens)
    model = build_model(config, device="meta")
    assert sorted(streams) == [0, 2] and keys == 2 * 4
    for layer, (stream, rows) in streams.items():  # the demo's own hashing, layer by layer
        assert stream == [i for row in demo_hash_ids(config, tokens, layer) for i in row]
        assert rows == model.ngram_hasher.num_rows_of(layer)
    report = simulate_ngram(config, tokens, [1.0, 0.0], ["lfu"])
    full, none = report["results"]
    assert full["misses"] == sum(len(set(s)) for s, _ in streams.values())  # each layer's cache misses its own ids
    assert none["hits"] == 0 and none["lookups"] == sum(len(s) for s, _ in streams.values())
    per_layer = zip(*(r["results"] for r in report["layers"].values()), strict=True)
    for cell, layer_cells in zip(report["results"], per_layer, strict=True):
        assert cell["hits"] == sum(c["hits"] for c in layer_cells)
        assert cell["hit_rate"] == pytest.approx(cell["hits"] / (cell["hits"] + cell["misses"]))
    assert report["rows"] == sum(rows for _, rows in streams.values())


def test_cli_reports_the_per_layer_caches_of_a_checkpoint(tmp_path, capsys):
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.cli.main import main
    from stemlm.data.tokenizer import default_tokenizer

    config = small_engram(engram_variant="reference", num_hidden_layers=3, ffn_layers="0,2", vocab_size=8192)
    folder = save_pretrained(build_model(config, seed=0), tmp_path / "ckpt", tokenizer=default_tokenizer())
    argv = ["cache-sim", str(folder), "--max-tokens", "300", "--fractions", "0.1", "--policy", "lfu", "--no-progress"]
    assert main([*argv, "--json"]) == 0
    ngram = json.loads(capsys.readouterr().out)["ngram"]
    assert sorted(ngram["layers"]) == ["0", "2"]
    assert ngram["results"][0]["lookups"] == 2 * 300 * 8  # layers x tokens x ids per token
