"""Nearest tokens against brute force; activated parameters against counting by hand."""

from __future__ import annotations

import pytest
import torch

from stemlm.analysis.activated import activated_vs_context, context_lengths
from stemlm.analysis.nearest import nearest_tokens, neighbours, query_token
from stemlm.errors import StemlmError


def test_neighbours_brute_force():
    w = torch.randn(30, 8)
    got = neighbours(w, 4, 5)
    cos = [(i, float(torch.cosine_similarity(w[4], w[i], dim=0))) for i in range(30) if i != 4]
    want = sorted(cos, key=lambda p: -p[1])[:5]
    assert [i for i, _ in got] == [i for i, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_nearest_tokens_tables(analysis_model, small_tokenizer):
    model = analysis_model()
    result = nearest_tokens(model, small_tokenizer, "France", k=4)
    assert result["query"] == " France"
    assert set(result["tables"]) == {"layer 1", "layer 2", "embed_tokens"}
    assert all(
        len(rows) == 4 and result["query_id"] not in [r["id"] for r in rows] for rows in result["tables"].values()
    )
    with pytest.raises(StemlmError, match="not a single token"):
        query_token(small_tokenizer, "Zanzibar", 512)


def test_context_lengths():
    assert context_lengths(100) == [16, 32, 64, 100]
    assert context_lengths(64) == [16, 32, 64]


def test_activated_by_hand(tiny_config):
    config = tiny_config("stem", vocab_size=512)  # STEM layers 1, 2; d_ff 128
    ids = [1, 2, 3, 1] * 8 + list(range(100, 132))  # 64 tokens
    result = activated_vs_context(config, ids, lengths=[4, 64], windows=1)
    four, full = result["by_context"]
    assert four == {"context": 4, "windows": 1, "distinct_tokens": 3, "activated_table_params": 2 * 128 * 3}
    assert full["distinct_tokens"] == 35 and full["activated_table_params"] == 2 * 128 * 35
    assert result["projection_replaced_layers"] == 2 and result["rows_per_token"] == 256
    dense = activated_vs_context(tiny_config("dense", vocab_size=512), ids, lengths=[8])
    assert dense["by_context"][0]["activated_table_params"] == 0
