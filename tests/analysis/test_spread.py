"""Angular spread: cosines against brute force, captured FFN inputs against a block-by-block re-run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stemlm.analysis.spread import angular_spread, cosine_stats, ffn_inputs, first_occurrences, pairwise_cosines
from stemlm.errors import StemlmError


def test_first_occurrences():
    assert first_occurrences([5, 3, 5, 7, 3, 9], 10) == ([5, 3, 7, 9], [0, 1, 3, 5])
    assert first_occurrences([5, 3, 5, 7], 2) == ([5, 3], [0, 1])


def test_pairwise_cosines_brute_force():
    v = torch.randn(6, 5)
    want = []
    for i in range(6):
        for j in range(i + 1, 6):
            a, b = v[i].double().numpy(), v[j].double().numpy()
            want.append(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    np.testing.assert_allclose(pairwise_cosines(v).numpy(), want, atol=1e-12)


def test_cosine_stats_match_numpy():
    cos = torch.rand(1001, dtype=torch.float64) * 2 - 1
    stats = cosine_stats(cos)
    x = cos.numpy()
    assert stats["mean"] == pytest.approx(x.mean()) and stats["std"] == pytest.approx(x.std(ddof=1))
    assert stats["mean_abs"] == pytest.approx(np.abs(x).mean())
    for p, value in stats["percentiles"].items():
        assert value == pytest.approx(np.percentile(x.astype(np.float32), float(p)), abs=1e-6)


def test_ffn_inputs_match_block_by_block_run(analysis_model):
    model = analysis_model()
    ids = [3, 17, 17, 42, 9, 100]
    captured = ffn_inputs(model, ids)
    x = model.model.embed_tokens(torch.tensor([ids]))
    rope = model.model.rotary_emb(torch.arange(len(ids))[None], x.dtype)
    from stemlm.model.ffn import TokenContext

    ctx = TokenContext(input_ids=torch.tensor([ids]))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), rope, None, None)
            h = layer.post_attention_layernorm(x)
            torch.testing.assert_close(captured[i], h[0])
            x = x + layer.mlp(h, ctx)


def test_angular_spread_numbers(analysis_model):
    stem, dense = analysis_model(), analysis_model("dense", seed=1)
    ids = [3, 17, 17, 42, 9, 100, 3, 250]
    result, samples = angular_spread(stem, ids, dense=dense)
    tokens, positions = [3, 17, 42, 9, 100, 250], [0, 1, 3, 4, 5, 7]
    assert result["tokens"] == 6 and set(result["layers"]) == {"1", "2"} and "dense" in result["baseline"]
    for layer in (1, 2):
        rows = stem.token_tables()[layer].weight.detach()[tokens]
        assert result["layers"][str(layer)]["label"] == f"layer {layer}"
        assert result["layers"][str(layer)]["stem_rows"]["mean"] == pytest.approx(float(pairwise_cosines(rows).mean()))
        centred = float(pairwise_cosines(rows - rows.mean(0)).abs().mean())
        assert result["layers"][str(layer)]["stem_rows"]["centred_mean_abs"] == pytest.approx(centred)
        with torch.no_grad():
            base = dense.model.layers[layer].mlp.up_proj(ffn_inputs(dense, ids)[layer][positions])
        torch.testing.assert_close(samples[f"layer {layer}"][1], pairwise_cosines(base))
    own, _ = angular_spread(stem, ids)
    assert "gate_proj" in own["baseline"]


def test_spread_errors(analysis_model):
    with pytest.raises(StemlmError, match="needs a STEM model"):
        angular_spread(analysis_model("dense"), [1, 2, 3, 4])
    with pytest.raises(StemlmError, match="fewer than 3 distinct"):
        angular_spread(analysis_model(), [1, 1, 2])


def test_ffn_inputs_run_long_texts_in_windows(analysis_model):
    model = analysis_model()  # max_position_embeddings 128
    ids = [(7 * i) % 500 for i in range(300)]
    captured = ffn_inputs(model, ids)
    assert captured[1].shape[0] == 300
    torch.testing.assert_close(captured[2][128:256], ffn_inputs(model, ids[128:256])[2])
    result, _ = angular_spread(model, ids, max_tokens=400)
    assert result["tokens"] == len(set(ids))
