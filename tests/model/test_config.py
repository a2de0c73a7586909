"""Tests of `stemlm.model.config`: layer specs, validation messages, command-line overrides and (de)serialisation."""

from __future__ import annotations

import json

import pytest

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig, resolve_layer_spec


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("all-but-first", [1, 2, 3, 4, 5, 6, 7]),
        ("odd", [1, 3, 5, 7]),
        ("half", [1, 3, 5, 7]),
        ("even", [0, 2, 4, 6]),
        ("every:4", [3, 7]),
        ("none", []),
        ("5, 2", [2, 5]),
        ([6, 1], [1, 6]),
    ],
)
def test_layer_specs(spec, expected):
    assert resolve_layer_spec(spec, 8) == expected


def test_paper_1b_placement_is_five_layers():
    assert resolve_layer_spec("every:3", 16) == [2, 5, 8, 11, 14]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(ffn_layers=[1, 9]), "layer index 9 is out of range for a model with 3 layers"),
        (dict(ffn_layers="1,1"), "lists a layer twice"),
        (dict(ffn_layers="first"), "bad layer spec 'first'"),
        (dict(ffn_layers="every:x"), "every:K needs an integer"),
        (dict(ffn_layers=[1.5]), "entries must be integer layer indices"),
        (dict(hidden_size=66, num_attention_heads=4), "num_attention_heads=4 does not divide hidden_size=66"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
        (dict(ffn="mlp"), "unknown ffn kind 'mlp'; choose one of dense, stem"),
        (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok=3 exceeds num_experts=2"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(head_dim=-8), "head_dim must be a positive integer or None"),
        (dict(head_dim=7), "head dimension 7 must be even"),
        (dict(table_init="uniform"), "table_init must be 'xavier' or 'normal'"),
        (dict(table_init_std=0.0), "table_init_std must be a positive number"),
        (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    ],
)
def test_invalid_configs_explain_themselves(tiny_config, changes, message):
    with pytest.raises(StemlmError, match=message):
        tiny_config(**changes)


def test_overrides_parse_by_field_type(tiny_config):
    config = tiny_config().with_overrides(
        [
            "model.hidden_size=128",
            "rope_theta=500000",
            "tie_word_embeddings=true",
            "num_key_value_heads=none",
            "ffn_layers=1,2",
            "ffn=moe",
            "table_init_std=0.01",
        ]
    )
    assert config.hidden_size == 128 and isinstance(config.hidden_size, int)
    assert config.rope_theta == 500000.0 and config.tie_word_embeddings is True
    assert config.num_key_value_heads is None and config.kv_heads == config.num_attention_heads
    assert config.ffn_layers == [1, 2] and config.ffn == "moe" and config.table_init_std == 0.01
    assert tiny_config().with_overrides(["ffn_layers=odd"]).special_layers == [1]
    assert tiny_config().with_overrides({"num_key_value_heads": "4"}).kv_heads == 4


@pytest.mark.parametrize(
    "override, message",
    [
        ("hidden_sise=128", "unknown config key 'hidden_sise'; valid keys: .*hidden_size"),
        ("model_type=llama", "unknown config key 'model_type'"),
        ("hidden_size=big", "config key 'hidden_size' expects an integer, got 'big'"),
        ("hidden_size=1.5", "expects an integer"),
        ("num_key_value_heads=two", "expects an integer or none"),
        ("rope_theta=fast", "expects a number"),
        ("tie_word_embeddings=maybe", "expects true or false"),
        ("hidden_size", "not of the form key=value"),
        ("num_experts_per_tok=9", "num_experts_per_tok=9 exceeds num_experts=4"),
    ],
)
def test_bad_overrides(tiny_config, override, message):
    with pytest.raises(StemlmError, match=message):
        tiny_config().with_overrides([override])


def test_hf_dict_round_trip_and_llama_fields(tiny_config):
    config = tiny_config("stem", ffn_layers="odd", num_key_value_heads=None)
    d = json.loads(config.to_json())
    assert d["model_type"] == "stemlm" and d["num_key_value_heads"] == 4 and d["head_dim"] == 16
    assert d["hidden_act"] == "silu" and d["resolved_ffn_layers"] == [1]
    back = ModelConfig.from_dict(d)
    assert back.special_layers == config.special_layers
    assert back.to_hf_dict() == config.to_hf_dict() | {"num_key_value_heads": 4, "head_dim": 16}
    with pytest.raises(StemlmError, match="model type 'llama'"):
        ModelConfig.from_dict(d | {"model_type": "llama"})


def test_stem_layers_is_the_old_name_of_ffn_layers(tiny_config):
    # config.json files and dicts written before the rename, and `--set model.stem_layers=...`
    d = tiny_config("stem").to_dict()
    old = {k: v for k, v in d.items() if k != "ffn_layers"} | {"stem_layers": "odd"}
    assert ModelConfig.from_dict(old).ffn_layers == "odd" and ModelConfig.from_dict(old).special_layers == [1]
    assert ModelConfig.from_dict(d | {"stem_layers": d["ffn_layers"]}) == ModelConfig.from_dict(d)  # agreeing
    with pytest.raises(StemlmError, match="both stem_layers='odd' and ffn_layers='all'"):
        ModelConfig.from_dict(d | {"ffn_layers": "all", "stem_layers": "odd"})
    assert tiny_config().with_overrides(["model.stem_layers=odd"]).ffn_layers == "odd"


def test_layer_ffn_and_dense_config(tiny_config):
    config = tiny_config("ple", ffn_layers=[2])
    assert [config.layer_ffn(i) for i in range(3)] == ["dense", "dense", "ple"]
    assert tiny_config("dense").special_layers == []


def test_explicit_head_dim_need_not_divide_hidden(tiny_config):
    config = tiny_config(hidden_size=66, num_attention_heads=4, head_dim=6)
    assert config.head_size == 6 and config.kv_heads == 2
