"""The kind registry (`stemlm.model.kinds.registry`): every module of the package is a kind and is found, the
kinds' declarations agree with the modules they build, their fields are flat config fields (old config.json
files load unchanged), and the forward's one `rows=` mapping reaches every table family.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_registry.py -q
"""

from __future__ import annotations

import dataclasses
import json
import pkgutil

import pytest
import torch

import stemlm.model.kinds as kinds_package
from stemlm.errors import StemlmError
from stemlm.hf.configuration import StemlmConfig
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS, TABLE_KINDS, ModelConfig
from stemlm.model.kinds.registry import FAMILIES, Field, all_kinds, get_kind, kind_fields

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)
# The config.json keys of a checkpoint written before the registry (commit 42bf8c5), all flat.
OLD_KEYS = (
    "num_experts num_experts_per_tok moe_intermediate_size moe_shared_expert router_z_loss hash_seed ple_dim "
    "stem_ngram_orders stem_ngram_heads stem_ngram_rows engram_orders engram_heads engram_rows engram_dim "
    "engram_kernel memory_keys memory_topk memory_heads memory_key_dim table_init table_init_std"
).split()


def test_every_module_of_the_package_is_a_registered_kind():
    modules = {m.name for m in pkgutil.iter_modules(kinds_package.__path__)} - {"registry"}
    assert {k.name for k in all_kinds()} == modules
    assert FFN_KINDS[:2] == ("dense", "stem") and len(set(FFN_KINDS)) == len(FFN_KINDS)
    assert list(FFN_KINDS) == [k.name for k in sorted(all_kinds(), key=lambda k: k.order)]
    assert set(TABLE_KINDS) == {k.name for k in all_kinds() if any(t.family == "token" for t in k.tables)}
    with pytest.raises(StemlmError, match="unknown ffn kind 'mamba'"):
        get_kind("mamba")


def test_kind_fields_are_flat_config_and_hf_fields():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    hf = set(StemlmConfig.__dataclass_fields__)
    for f in kind_fields():
        assert f.name in names and f.name in hf
        assert getattr(ModelConfig(), f.name) == f.default == getattr(StemlmConfig(), f.name)
    assert set(OLD_KEYS) <= names
    config = ModelConfig(ffn="engram", engram_dim=128, engram_heads=2)
    assert config.engram_dim == 128 and json.loads(config.to_json())["engram_dim"] == 128
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(StemlmError, match="memory_topk must be a positive integer"):
        ModelConfig(memory_topk=0)
    with pytest.raises(StemlmError, match="moe_shared_expert must be true or false"):
        ModelConfig(moe_shared_expert="yes")


def test_field_checks_follow_the_declared_type():
    errors = []

    def need(ok, message):
        if not ok:
            errors.append(message)

    Field("a", "int | None", None, "", positive=True).check(None, need)
    Field("b", "int", 1, "").check(-3, need)  # not positive: any integer
    Field("c", "float", 1.0, "", positive=True).check(0.0, need)
    Field("d", "bool", False, "").check(1, need)
    assert errors == ["c must be a positive number, got 0.0", "d must be true or false, got 1"]


def test_variant_settings_name_a_variant_and_config_fields_that_build():
    declared = {k.name: k.variant_settings for k in all_kinds() if k.variant_settings}
    assert declared == {"value_embed": {"reference": {"ffn_layers": "1,2,-3,-2,-1"}}}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for kind, variants in declared.items():
        for variant, settings in variants.items():
            assert set(settings) <= names
            config = ModelConfig(ffn=kind, num_hidden_layers=6, **{f"{kind}_variant": variant, **settings})
            assert config.special_layers == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_declared_tables_and_components_match_the_module(tiny_config, kind):
    config = tiny_config(kind, **SMALL)
    model = build_model(config, device="meta")
    spec = get_kind(kind)
    for i in config.special_layers:
        mlp = model.model.layers[i].mlp
        for table in spec.tables:
            assert table.family in FAMILIES
            assert isinstance(getattr(mlp, table.attr), (torch.nn.Embedding, torch.nn.EmbeddingBag))
        for name in spec.trains_with_tables:  # a variant may lack one (value_embed's gates are the reference's)
            assert isinstance(getattr(mlp, name, None), (torch.nn.Parameter, torch.nn.Module, type(None)))
        assert any(hasattr(mlp, name) for name in spec.trains_with_tables) or not spec.trains_with_tables
    assert set(spec.table_components) <= set(spec.components)
    for i in range(config.num_hidden_layers):  # every component a layer counts is declared (accounting raises)
        acc._layer(config, i)
    families = {t.family for t in spec.tables}
    assert set(model.lookup_tables()) == (families if config.special_layers else set())


def test_rows_mapping_reaches_every_family_and_refuses_unknown_ones(tiny_config):
    model = build_model(tiny_config("stem_ngram", stem_ngram_rows=32), seed=0).eval()
    ids = torch.randint(0, 256, (2, 6))
    seen = []
    tables = model.lookup_tables()

    def provider(family):
        def rows(layer_idx, keys):
            seen.append((family, layer_idx))
            return tables[family][layer_idx](keys)

        return rows

    with torch.no_grad():
        plain = model(ids).logits
        hooked = model(ids, rows={"token": provider("token"), "ngram": provider("ngram"), "memory": None}).logits
    assert torch.equal(hooked, plain)
    assert seen == [(f, i) for i in model.config.special_layers for f in ("token", "ngram")]
    with pytest.raises(StemlmError, match="unknown table families"):
        model(ids, rows={"stem": provider("token")})
