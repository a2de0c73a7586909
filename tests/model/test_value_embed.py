"""Tests of the `value_embed` kind (modded-nanogpt's value embeddings): the forward against a dense model whose
attention values are mixed by hand, shared tables, config checks, KV-cache decoding against the full forward
(chunked, cropped, left-padded), save/load and Hugging Face Auto loading with generate().

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_value_embed.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.hf.configuration import StemlmConfig
from stemlm.model import build_model
from tests.model.round_trip import assert_hf_generate_is_greedy


def config(tiny_config, **extra):
    return tiny_config("value_embed", **{"num_hidden_layers": 4, "ffn_layers": "all", **extra})


def randomized(model, seed=0):
    """Every parameter random (λ included), so a term left out cannot hide behind an initial value."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") or name.endswith("value_lambda") else noise)
    return model.eval()


def by_hand(model, ids):
    """The logits of the dense twin with the same weights, each selected layer's v_proj output replaced by
    λ0 · v + λ1 · VE_owner[t] in a forward hook: the formula, written against the unmodified attention."""
    cfg = model.config
    dense = build_model(cfg.replace(ffn="dense")).eval()
    state = {k: v for k, v in model.state_dict().items() if "value_" not in k}
    dense.load_state_dict(state)
    n = cfg.value_embed_tables or len(cfg.special_layers)
    handles = []
    for j, i in enumerate(cfg.special_layers):
        owner = cfg.special_layers[j % n]
        table = model.state_dict()[f"model.layers.{owner}.mlp.value_embedding.weight"]
        lam = model.state_dict()[f"model.layers.{i}.mlp.value_lambda"]

        def hook(_module, _inputs, v, table=table, lam=lam):
            return lam[0] * v + lam[1] * table[ids]

        handles.append(dense.model.layers[i].self_attn.v_proj.register_forward_hook(hook))
    with torch.no_grad():
        logits = dense(ids).logits
    for h in handles:
        h.remove()
    return logits


@pytest.mark.parametrize("tables", [None, 1, 2])
def test_forward_equals_values_mixed_by_hand(tiny_config, tables):
    model = randomized(build_model(config(tiny_config, value_embed_tables=tables)))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, by_hand(model, ids), atol=1e-5, rtol=1e-5)
    # the mix is really there: the dense twin alone gives other logits
    dense = build_model(model.config.replace(ffn="dense")).eval()
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if "value_" not in k})
    with torch.no_grad():
        assert not torch.allclose(dense(ids).logits, got, atol=1e-3)


def test_shared_tables_have_one_name_and_one_key(tiny_config):
    model = build_model(config(tiny_config, value_embed_tables=2))
    names = [k for k in model.state_dict() if k.endswith("value_embedding.weight")]
    assert names == ["model.layers.0.mlp.value_embedding.weight", "model.layers.1.mlp.value_embedding.weight"]
    tables = model.token_tables()
    assert sorted(tables) == [0, 1]
    assert (
        model.model.layers[2].mlp.value_embedding is tables[0]
        and model.model.layers[3].mlp.value_embedding is tables[1]
    )
    seen = []

    def own(layer_idx, input_ids):
        seen.append(layer_idx)
        return tables[layer_idx](input_ids)

    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids, rows={"token": own}).logits, model(ids).logits)
    assert seen == [0, 1, 0, 1]  # layer j asks for the rows of table j mod 2, under its owner's index
    # moved with the model: the sharing layer still reads the owner's (converted) table
    model.to(torch.float64)
    assert model.model.layers[2].mlp.value_embedding.weight.dtype == torch.float64


def test_config_checks_and_hf_field(tiny_config):
    with pytest.raises(StemlmError, match="value_embed_tables=5 exceeds the 4 layers"):
        config(tiny_config, value_embed_tables=5)
    with pytest.raises(StemlmError, match="value_embed_tables must be a positive integer or None"):
        config(tiny_config, value_embed_tables=0)
    assert config(tiny_config).with_overrides(["value_embed_tables=3"]).value_embed_tables == 3
    hf = StemlmConfig.from_model_config(config(tiny_config, value_embed_tables=2))
    assert hf.value_embed_tables == 2 and hf.to_model_config().value_embed_tables == 2


def test_starts_as_its_dense_twin_plus_the_row(tiny_config):
    model = build_model(config(tiny_config), seed=3)
    for i in model.config.special_layers:
        assert torch.equal(model.model.layers[i].mlp.value_lambda.detach(), torch.ones(2))
    table = model.token_tables()[1].weight
    width = model.config.kv_heads * model.config.head_size
    assert table.shape == (256, width)
    std = float(table.detach().double().std())
    assert std == pytest.approx((2 / (256 + width)) ** 0.5, rel=0.05)  # table_init="xavier", like STEM


@pytest.mark.parametrize("tables", [None, 2])
def test_kv_cache_decoding_equals_full_forward(tiny_config, tables):
    model = randomized(build_model(config(tiny_config, value_embed_tables=tables)))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)  # prefill, then a chunk of 3, then one token at a time
        pieces, cache = [out.logits], out.past_key_values
        pieces.append(model(ids[:, 5:8], past_key_values=cache).logits)
        for t in range(8, 16):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
        # float rounding only: 4 layers of random weights (λ near 1) give logits of a few units, so 5e-5
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=5e-5, rtol=1e-5)
        cache.crop(6)
        torch.testing.assert_close(model(ids[:, 6:9], past_key_values=cache).logits, full[:, 6:9], atol=5e-5, rtol=1e-5)


def test_left_padding(tiny_config):
    model = randomized(build_model(config(tiny_config)))
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([torch.full((1, 3), 5), ids], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(padded, attention_mask=mask).logits[:, 3:], model(ids).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("tables", [None, 1])
def test_save_load_and_hf_generate(tmp_path, tiny_config, tables):
    model = randomized(build_model(config(tiny_config, value_embed_tables=tables)), seed=7)
    hf = assert_hf_generate_is_greedy(model, tmp_path / "ckpt")
    assert hf.config.ffn == "value_embed" and hf.config.value_embed_tables == tables
