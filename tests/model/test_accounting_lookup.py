"""Accounting of the lookup kinds (`stem_ngram`, `engram`, `memory`) against the meta-device model, FlopCounterMode
on real forwards (per layer and in total, prefill and decode) and the gradients of one decode step.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_accounting_lookup.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from stemlm.model import accounting as acc
from stemlm.model import build_model
from tests.model import test_accounting as accounting
from tests.model.test_accounting import SHAPE_IDS, SHAPES, math_attention

KINDS = ["stem_ngram", "engram", "memory"]
SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)
COMPONENT = {  # parameter-name fragment -> component (independent of accounting's bookkeeping)
    "stem_embedding": "token_tables",
    "ngram_embedding": "ngram_tables",
    "engram_embedding": "ngram_tables",
    "memory_values": "memory_values",
    "engram_key_proj": "engram_proj",
    "engram_value_proj": "engram_proj",
    "engram_conv.": "engram_proj",
    "memory_": "memory_proj",
}


def config_for(tiny_config, kind, shape):
    return accounting.config_for(tiny_config, kind, shape, stem_ngram_orders="2,3", **SMALL)


def component_of(name: str, config) -> str:
    return accounting.component_of(name, config, COMPONENT, stem_kinds=("stem_ngram",))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_counts_match_meta_model(tiny_config, kind, shape):
    config = config_for(tiny_config, kind, shape)
    model = build_model(config, device="meta")
    measured = dict.fromkeys(acc.PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():
        measured[component_of(name, config)] += p.numel()
    assert acc.parameter_counts(config) == measured
    tables = [t for family in model.lookup_tables().values() for t in family.values()]
    active = acc.active_parameters(config)
    assert active["backbone"] == model.num_parameters() - sum(t.weight.numel() for t in tables)


def measure(model, ids, **kwargs):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, **kwargs)
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module


@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
@pytest.mark.parametrize("kind", KINDS)
def test_flops_equal_flop_counter(tiny_config, monkeypatch, kind, shape):
    config = config_for(tiny_config, kind, shape)
    model = build_model(config).eval()
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    B, T = 2, 12
    ids = torch.randint(0, config.vocab_size, (B, T))
    total, per_module = measure(model, ids)
    assert total == acc.prefill_flops(config, T, B, "full")
    for i in range(config.num_hidden_layers):  # each FFN on its own: the layer's matmul weights, 2 FLOPs each
        used = acc._layer(config, i)[1]
        ffn = sum(v for k, v in used.items() if k != "attention")
        assert per_module[f"StemLM.model.layers.{i}.mlp"] == 2 * ffn * B * T
    with torch.no_grad():
        cache = model(ids[:1, :11], use_cache=True).past_key_values
    total, _ = measure(model, ids[:1, 11:], past_key_values=cache)
    assert total == acc.decode_flops_per_token(config, 12)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_params_touched_equal_nonzero_gradients(tiny_config, kind):
    config = config_for(tiny_config, kind, SHAPES[0])
    model = build_model(config).eval()
    with torch.no_grad():  # nonzero n-gram rows, so a row's gradient cannot vanish through a zero weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, config.vocab_size, (1, 14))
    with torch.no_grad():
        cache = model(ids[:, :13], use_cache=True).past_key_values  # > the conv's 9 positions of context
    out = model(ids[:, 13:], past_key_values=cache)
    (out.logits * torch.randn_like(out.logits)).sum().backward()
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    if kind == "memory":
        # Every sub-key is read to score it, but only the selected ones get a gradient.
        keys = [m.mlp.memory_keys for m in model.model.layers if hasattr(m.mlp, "memory_keys")]
        touched += sum(int((k.grad == 0).sum()) for k in keys)
        values = [t.weight.grad for t in model.tables("memory").values()]
        rows = sum(int((g != 0).any(1).sum()) for g in values)
        heads_x_topk = config.memory_heads * config.memory_topk
        assert rows <= 2 * heads_x_topk  # two memory layers; heads may pick the same row
        # the formula counts h·k rows per layer: add the rows the heads shared
        touched += (2 * heads_x_topk - rows) * config.hidden_size
    assert touched == acc.decode_params_touched(config)


def test_info_lists_the_lookup_tables(tiny_config):
    config = config_for(tiny_config, "engram", SHAPES[0])
    summary = acc.summarize(config, 64)
    assert summary["parameters"]["components"]["ngram_tables"] > 0
    assert summary["flops"]["forward_per_token"]["engram_proj"] > 0
    assert summary["flops"]["saving_vs_dense_twin"] < 0  # Engram adds compute to the kept dense FFN
    stem = acc.summarize(config_for(tiny_config, "stem_ngram", SHAPES[0]), 64)
    assert stem["stem"]["layer_saving_fraction"] > 0  # same FLOPs as STEM: the n-gram rows are lookups
