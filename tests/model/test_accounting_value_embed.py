"""Accounting of `value_embed` against the meta-device model (by component, shared tables counted once),
FlopCounterMode on real forwards (the mix adds no FLOPs: the dense twin's count, prefill and decode) and the
nonzero gradients of one decode step (parameters touched).

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_accounting_value_embed.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from stemlm.model import accounting as acc
from stemlm.model import build_model
from tests.model.test_accounting import SHAPE_IDS, SHAPES, math_attention

TABLES = [None, 2]


def config_for(tiny_config, shape, tables):
    tied, kv, head_dim = shape
    return tiny_config(
        "value_embed",
        tie_word_embeddings=tied,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=5,
        ffn_layers="0,1,3,4",
        value_embed_tables=tables,
    )


def component_of(name: str) -> str:  # independent of accounting's bookkeeping
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    if name == "lm_head.weight":
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if name.endswith("value_embedding.weight"):
        return "value_tables"
    if name.endswith("value_lambda"):
        return "value_mix"
    return "ffn_dense"


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_parameter_counts_match_meta_model(tiny_config, shape, tables):
    config = config_for(tiny_config, shape, tables)
    model = build_model(config, device="meta")
    measured = dict.fromkeys(acc.PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():  # a shared table is one parameter
        measured[component_of(name)] += p.numel()
    assert acc.parameter_counts(config) == measured
    table_params = sum(t.weight.numel() for t in model.token_tables().values())
    assert len(model.token_tables()) == (tables or 4)
    active = acc.active_parameters(config)
    assert active["backbone"] == model.num_parameters() - table_params
    assert active["rows"] == (tables or 4) * config.kv_heads * config.head_size  # one row per table


def measure(model, ids, **kwargs):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, **kwargs)
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_flops_equal_flop_counter_and_the_dense_twin(tiny_config, monkeypatch, shape):
    config = config_for(tiny_config, shape, 2)
    model = build_model(config).eval()
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    B, T = 2, 12
    ids = torch.randint(0, config.vocab_size, (B, T))
    total, per_module = measure(model, ids)
    assert (
        total == acc.prefill_flops(config, T, B, "full") == acc.prefill_flops(config.replace(ffn="dense"), T, B, "full")
    )
    for i in range(config.num_hidden_layers):
        ffn = sum(v for k, v in acc._layer(config, i)[1].items() if k != "attention")
        assert per_module[f"StemLM.model.layers.{i}.mlp"] == 2 * ffn * B * T
        attention = acc._layer(config, i)[1]["attention"]
        scores = acc._score_flops_per_pair(config) // config.num_hidden_layers * B * T * T
        assert per_module[f"StemLM.model.layers.{i}.self_attn"] == 2 * attention * B * T + scores
    with torch.no_grad():
        cache = model(ids[:1, :11], use_cache=True).past_key_values
    total, _ = measure(model, ids[:1, 11:], past_key_values=cache)
    assert total == acc.decode_flops_per_token(config, 12)
    summary = acc.summarize(config, 64)
    assert summary["flops"]["saving_vs_dense_twin"] == 0
    assert (
        summary["parameters"]["components"]["value_tables"]
        == 2 * config.vocab_size * config.kv_heads * config.head_size
    )


@pytest.mark.parametrize("tables", TABLES)
def test_decode_params_touched_equal_nonzero_gradients(tiny_config, tables):
    config = config_for(tiny_config, SHAPES[0], tables)
    model = build_model(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, config.vocab_size, (1, 10))
    with torch.no_grad():
        cache = model(ids[:, :9], use_cache=True).past_key_values
    out = model(ids[:, 9:], past_key_values=cache)
    (out.logits * torch.randn_like(out.logits)).sum().backward()
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    assert touched == acc.decode_params_touched(config)  # a shared table's row: one row, read by two layers
