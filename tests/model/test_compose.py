"""Kinds composed per layer: value embeddings and the Engram branch beside another FFN kind (`value_embed_layers`,
`engram_layers`). Layer specs, config checks, parameter names and table keys; the side modules against the kinds'
own modules (the same math: bitwise equal with the same weights) and against the formula by hand; KV-cache decoding;
parameters and FLOPs against the meta model and FlopCounterMode; save/load and `AutoModelForCausalLM`.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_compose.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.hf.configuration import StemlmConfig
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.config import resolve_layer_spec
from stemlm.model.kinds.registry import key_label, key_layer
from tests.model.test_accounting import math_attention
from tests.model.test_value_embed import randomized

MODDED = {"value_embed_layers": "first:3,last:3", "value_embed_tables": 3}  # modded-nanogpt's placement


def composed(tiny_config, ffn="stem", **extra):
    """STEM on the odd layers of six, value embeddings on the first and last three (tables shared 0 1 2 0 1 2)."""
    return tiny_config(ffn, **{"num_hidden_layers": 6, "ffn_layers": "odd", **MODDED, **extra})


def test_layer_specs_count_from_both_ends():
    assert resolve_layer_spec("first:3,last:3", 8) == [0, 1, 2, 5, 6, 7]
    assert resolve_layer_spec("0,1,2,-3,-2,-1", 8) == [0, 1, 2, 5, 6, 7]
    assert resolve_layer_spec([-1, 0], 4) == [0, 3]
    assert resolve_layer_spec("first:0", 4) == []
    with pytest.raises(StemlmError, match="lists a layer twice"):
        resolve_layer_spec("first:3,last:3", 4)
    with pytest.raises(StemlmError, match="asks for 5 of 4 layers"):
        resolve_layer_spec("last:5", 4)
    with pytest.raises(StemlmError, match="out of range"):
        resolve_layer_spec("-5", 4)
    with pytest.raises(StemlmError, match="bad layer spec"):
        resolve_layer_spec("first:x", 4)


def test_config_fields_checks_and_hf(tiny_config):
    config = composed(tiny_config)
    assert config.beside_layers("value_embed") == [0, 1, 2, 3, 4, 5]
    assert config.layer_kinds(1) == ("stem", "value_embed") and config.layer_kinds(0) == ("dense", "value_embed")
    assert tiny_config("stem").with_overrides(["value_embed_layers=first:2"]).beside_layers("value_embed") == [0, 1]
    hf = StemlmConfig.from_model_config(config)
    assert hf.value_embed_layers == "first:3,last:3" and hf.to_model_config() == config
    with pytest.raises(StemlmError, match="which is value_embed already"):
        tiny_config("value_embed", value_embed_layers="0")
    with pytest.raises(StemlmError, match="value_embed_tables=4 exceeds the 2 layers in value_embed_layers"):
        tiny_config("stem", value_embed_layers="0,1", value_embed_tables=4)
    with pytest.raises(StemlmError, match="one n-gram kind per model"):
        tiny_config("stem_ngram", engram_layers="0")
    with pytest.raises(StemlmError, match="out of range"):
        tiny_config("stem", engram_layers="9")


def test_side_modules_have_their_own_names_and_keys(tiny_config):
    model = build_model(composed(tiny_config))
    names = [n for n in model.state_dict() if "value_" in n]
    assert [n for n in names if n.endswith("value_embedding.weight")] == [
        f"model.layers.{i}.beside.value_embed.value_embedding.weight" for i in (0, 1, 2)
    ]
    assert all(".beside.value_embed." in n for n in names)
    tables = model.tables("token")
    assert list(tables) == [1, 3, 5, 12, 13, 14]  # STEM at its layers; value tables past the 6 layers
    assert [key_layer(model.config, k) for k in tables] == [1, 3, 5, 0, 1, 2]
    assert key_label(model.config, 13) == "layer 1 value_embed" and key_label(model.config, 3) == "layer 3"
    assert model.token_tables() == tables
    assert model.model.layers[4].beside.value_embed.value_embedding is tables[13]  # layer 4 shares table 1
    seen = []

    def own(key, input_ids):
        seen.append(key)
        return tables[key](input_ids)

    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids, rows={"token": own}).logits, model(ids).logits)
    assert seen == [12, 13, 1, 14, 12, 3, 13, 14, 5]  # per layer: its value table (attention), then STEM (FFN)


def renamed(state, side):
    """A kind module's parameters under the side module's names (`mlp.value_*` -> `beside.value_embed.value_*`)."""
    out = {}
    for name, value in state.items():
        for attr in ("value_", "engram_"):
            name = name.replace(f".mlp.{attr}", f".beside.{side}.{attr}")
        out[name] = value
    return out


@pytest.mark.parametrize(
    "kind, extra",
    [("value_embed", {"value_embed_tables": 2}), ("engram", {"engram_dim": 32, "engram_rows": 61})],
)
def test_side_module_computes_what_the_kind_does(tiny_config, kind, extra):
    """A dense model with the kind beside it on some layers is the kind's model with those layers, bitwise."""
    as_ffn = randomized(build_model(tiny_config(kind, num_hidden_layers=4, ffn_layers="0,2,3", **extra)))
    side = build_model(tiny_config("dense", num_hidden_layers=4, **{f"{kind}_layers": "0,2,3"}, **extra)).eval()
    state = as_ffn.state_dict()
    side.load_state_dict(renamed(state, kind))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(side(ids).logits, as_ffn(ids).logits)
    assert {k for k, v in side.lookup_tables().items()} == {k for k, v in as_ffn.lookup_tables().items()}


def by_hand(model, ids):
    """The logits of the STEM model alone with the same weights, each value layer's v_proj output replaced by
    λ0 · v + λ1 · VE_owner[t] in a forward hook (the formula, against the unmodified attention)."""
    config = model.config
    stem = build_model(config.replace(value_embed_layers="none", value_embed_tables=None)).eval()
    stem.load_state_dict({k: v for k, v in model.state_dict().items() if ".beside." not in k})
    layers, state, handles = config.beside_layers("value_embed"), model.state_dict(), []
    for j, i in enumerate(layers):
        owner = layers[j % config.value_embed_tables]
        table = state[f"model.layers.{owner}.beside.value_embed.value_embedding.weight"]
        lam = state[f"model.layers.{i}.beside.value_embed.value_lambda"]

        def hook(_module, _inputs, v, table=table, lam=lam):
            return lam[0] * v + lam[1] * table[ids]

        handles.append(stem.model.layers[i].self_attn.v_proj.register_forward_hook(hook))
    with torch.no_grad():
        logits = stem(ids).logits
    for h in handles:
        h.remove()
    return logits


def test_stem_with_value_embeddings_equals_the_formula(tiny_config):
    model = randomized(build_model(composed(tiny_config)))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, by_hand(model, ids), atol=1e-5, rtol=1e-5)


def test_kv_cache_decoding_equals_full_forward(tiny_config):
    config = composed(tiny_config, engram_layers="2,4", engram_dim=32, engram_rows=61)
    model = randomized(build_model(config))
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        for t in range(5, 14):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=5e-5, rtol=1e-5)


def component_of(name: str) -> str:  # independent of accounting's bookkeeping
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return name.split(".")[-2]
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    for suffix, component in [
        ("value_embedding.weight", "value_tables"),
        ("value_lambda", "value_mix"),
        ("stem_embedding.weight", "token_tables"),
        ("engram_embedding.weight", "ngram_tables"),
    ]:
        if name.endswith(suffix):
            return component
    if ".engram_" in name:
        return "engram_proj"
    return "stem_proj" if ".mlp." in name and any(f"layers.{i}." in name for i in (1, 3, 5)) else "ffn_dense"


@pytest.mark.parametrize("engram", ["none", "2,4"])
def test_parameters_and_flops_are_exact(tiny_config, monkeypatch, engram):
    config = composed(tiny_config, engram_layers=engram, engram_dim=32, engram_rows=61, num_key_value_heads=2)
    meta = build_model(config, device="meta")
    measured = dict.fromkeys(acc.PARAM_COMPONENTS, 0)
    for name, p in meta.named_parameters():
        measured[component_of(name)] += p.numel()
    assert acc.parameter_counts(config) == measured
    assert acc.total_parameters(config) == meta.num_parameters()
    table_params = sum(t.weight.numel() for family in meta.lookup_tables().values() for t in family.values())
    assert acc.active_parameters(config)["backbone"] == meta.num_parameters() - table_params

    model = build_model(config).eval()
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    B, T = 2, 12
    ids = torch.randint(0, config.vocab_size, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == acc.prefill_flops(config, T, B, "full")
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    scores = acc._score_flops_per_pair(config) // config.num_hidden_layers * B * T * T
    for i in range(config.num_hidden_layers):
        assert per_module[f"StemLM.model.layers.{i}"] == 2 * sum(acc._layer(config, i)[1].values()) * B * T + scores
    with torch.no_grad():
        cache = model(ids[:1, :11], use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            model(ids[:1, 11:], past_key_values=cache)
    assert counter.get_total_flops() == acc.decode_flops_per_token(config, 12)


def test_decode_params_touched_equal_nonzero_gradients(tiny_config):
    model = randomized(build_model(composed(tiny_config)))
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        cache = model(ids[:, :9], use_cache=True).past_key_values
    out = model(ids[:, 9:], past_key_values=cache)
    (out.logits * torch.randn_like(out.logits)).sum().backward()
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    assert touched == acc.decode_params_touched(model.config)


def test_save_load_and_auto_model(tmp_path, tiny_config):
    model = randomized(build_model(composed(tiny_config, engram_layers="2", engram_dim=32, engram_rows=61)), seed=7)
    save_pretrained(model, tmp_path / "ckpt")
    loaded = from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(loaded(ids).logits, expected)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert hf.config.value_embed_layers == "first:3,last:3" and hf.config.engram_layers == "2"
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, expected)


def test_resize_grows_side_tables_and_keeps_them_shared(tiny_config):
    from stemlm.model.resize import resize_vocabulary

    model = randomized(build_model(composed(tiny_config)))
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    resize_vocabulary(model, 300)
    tables = model.tables("token")
    assert list(tables) == [1, 3, 5, 12, 13, 14] and all(t.weight.shape[0] == 300 for t in tables.values())
    assert model.model.layers[5].beside.value_embed.value_embedding is tables[14]  # still the owner's (new) table
    with torch.no_grad():  # the old ids read their old rows
        torch.testing.assert_close(model(ids).logits[..., :256], before, atol=0, rtol=0)
