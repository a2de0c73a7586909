"""Tests of `stemlm.model.accounting` against independent routes: the meta-device model for parameters,
`torch.utils.flop_counter.FlopCounterMode` on real forwards for FLOPs (attention replaced by explicit matmuls
so its FLOPs are counted), gradients for the parameters a decode step touches, and the seed's closed forms.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_accounting.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from stemlm.errors import StemlmError
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.presets import get_preset, list_presets

KINDS = ["dense", "stem", "stem_gate", "moe", "hash_moe", "ple"]
# (tied, kv heads, head_dim): untied MHA; tied GQA; untied GQA with head_dim * heads != hidden_size.
SHAPES = [(False, 4, None), (True, 2, None), (False, 2, 24)]
SHAPE_IDS = ["untied-mha", "tied-gqa", "gqa-wide-heads"]


def config_for(tiny_config, kind, shape, **extra):
    tied, kv, head_dim = shape
    return tiny_config(
        kind,
        tie_word_embeddings=tied,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=4,
        ffn_layers="1,3",
        **extra,
    )


# ----------------------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------------------
COMPONENT = {  # parameter-name fragment under .mlp. -> component
    "stem_embedding": "token_tables",
    "ple_embedding": "ple_tables",
    "router": "moe_router",
    "experts": "moe_experts",
    "shared_expert": "moe_shared",
    "ple_gate": "ple_proj",
    "ple_proj": "ple_proj",
}


def component_of(name: str, config, parts=COMPONENT, stem_kinds=("stem", "stem_gate")) -> str:
    """Classify a parameter by its HF-style name (independent of accounting's own bookkeeping): `parts` maps name
    fragments under `.mlp.` to components; the other FFN projections are `stem_proj` in layers of `stem_kinds`."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    if name == "lm_head.weight":
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    for part, component in parts.items():
        if f".mlp.{part}" in name:
            return component
    layer = int(name.split(".")[2])
    return "stem_proj" if config.layer_ffn(layer) in stem_kinds else "ffn_dense"


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_counts_match_meta_model(tiny_config, kind, shape, shared):
    config = config_for(tiny_config, kind, shape, moe_shared_expert=shared)
    model = build_model(config, device="meta")
    measured = dict.fromkeys(acc.PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():
        measured[component_of(name, config)] += p.numel()
    assert acc.parameter_counts(config) == measured
    assert acc.total_parameters(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list_presets())
def test_preset_parameter_counts_match_meta_model(name):
    config = get_preset(name)
    assert acc.total_parameters(config) == sum(p.numel() for p in build_model(config, device="meta").parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_active_parameters(tiny_config, kind):
    config = config_for(tiny_config, kind, SHAPES[1], moe_shared_expert=True)
    model = build_model(config, device="meta")
    tables = sum(t.weight.numel() for t in model.token_tables().values())
    unrouted = 0
    for i in config.special_layers:
        experts = getattr(model.model.layers[i].mlp, "experts", None)
        if experts is not None:
            k = config.num_experts_per_tok if kind == "moe" else 1
            unrouted += sum(p.numel() for p in experts.parameters()) * (experts.num_experts - k) // experts.num_experts
    active = acc.active_parameters(config)
    assert active["backbone"] == model.num_parameters() - tables - unrouted
    widths = [t.weight.shape[1] for t in model.token_tables().values()]
    assert active["with_rows"] - active["backbone"] == active["rows"] == sum(widths)


# ----------------------------------------------------------------------------------------------------------
# FLOPs against FlopCounterMode
# ----------------------------------------------------------------------------------------------------------
def grouped(attention):
    """SDPA's `enable_gqa` for an explicit replacement: the query heads of a group [B, kv, g, T, hd] against their
    one key/value head [B, kv, 1, S, hd], broadcast by matmul (no repeated copies are made)."""

    def run(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kwargs):
        assert attn_mask is None
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads == kv_heads:
            return attention(q, k, v, is_causal)
        assert enable_gqa and heads % kv_heads == 0
        q = q.unflatten(1, (kv_heads, heads // kv_heads))
        return attention(q, k.unsqueeze(2), v.unsqueeze(2), is_causal).flatten(1, 2)

    return run


@grouped
def math_attention(q, k, v, is_causal):
    """SDPA as two explicit matmuls over the full score matrix (what math SDPA computes)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal:
        T, S = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return torch.matmul(scores.softmax(-1), v)


@grouped
def causal_rows_attention(q, k, v, is_causal):
    """Causal attention computing only the needed keys: query i of T sees the first S - T + i + 1 keys."""
    T, S = q.shape[-2], k.shape[-2]
    rows = []
    for i in range(T):
        n = S - T + i + 1
        p = (torch.matmul(q[..., i : i + 1, :], k[..., :n, :].transpose(-2, -1)) / math.sqrt(q.shape[-1])).softmax(-1)
        rows.append(torch.matmul(p, v[..., :n, :]))
    return torch.cat(rows, dim=-2)


@pytest.mark.parametrize("replacement", [math_attention, causal_rows_attention])
def test_attention_replacements_equal_sdpa(tiny_model, monkeypatch, replacement):
    model = tiny_model("stem")
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        reference = model(ids).logits
        monkeypatch.setattr(F, "scaled_dot_product_attention", replacement)
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)


def measure(model, ids, **kwargs) -> tuple[int, dict[str, int]]:
    """FlopCounterMode total and per-component totals (from its per-module breakdown) of one forward."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, **kwargs)
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    parts = dict.fromkeys(acc.FLOP_COMPONENTS, 0)
    for name, flops in per_module.items():
        path = name.split(".")[1:]  # drop the root "StemLM"
        if path == ["lm_head"]:
            parts["lm_head"] += flops
        elif len(path) == 4 and path[3] == "self_attn":
            projections = sum(per_module.get(f"{name}.{p}", 0) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            parts["attn_proj"] += projections
            parts["attn_scores"] += flops - projections
        elif len(path) == 5 and path[3] == "mlp":
            kind = model.config.layer_ffn(int(path[2]))
            leaf = {
                "router": "moe_router",
                "experts": "moe_experts",
                "shared_expert": "moe_shared",
                "ple_gate": "ple_proj",
                "ple_proj": "ple_proj",
            }.get(path[4])
            parts[leaf or ("stem_proj" if kind in ("stem", "stem_gate") else "ffn_dense")] += flops
    return counter.get_total_flops(), parts


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_flops_equal_flop_counter(tiny_config, monkeypatch, kind, shape):
    config = config_for(tiny_config, kind, shape, moe_shared_expert=kind == "moe")
    model = build_model(config).eval()
    B, T = 2, 12
    ids = torch.randint(0, config.vocab_size, (B, T))
    for mode, replacement in (("full", math_attention), ("causal", causal_rows_attention)):
        monkeypatch.setattr(F, "scaled_dot_product_attention", replacement)
        total, parts = measure(model, ids)
        assert total == acc.prefill_flops(config, T, B, mode)
        expected = acc.forward_flops_per_token(config, T, mode)
        assert {k: v / (B * T) for k, v in parts.items()} == {k: expected[k] for k in acc.FLOP_COMPONENTS}
        assert expected["total"] * B * T == total


def test_cpu_sdpa_counts_no_flops(tiny_model):
    # FlopCounterMode has formulas for the flash / efficient / cuDNN kernels only; the CPU kernel counts 0, which
    # is why the other tests replace SDPA by explicit matmuls.
    model = tiny_model("dense")
    ids = torch.randint(0, 256, (2, 10))
    total, parts = measure(model, ids)
    assert parts["attn_scores"] == 0
    assert (
        total
        == acc.prefill_flops(model.config, 10, 2)
        - 2 * 10 * acc.forward_flops_per_token(model.config, 10)["attn_scores"]
    )


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_real_sdpa_flops_with_shared_kv_heads(tiny_config, monkeypatch, shape):
    # torch's own count of SDPA with `enable_gqa` (no replacement): on the meta device SDPA decomposes into its
    # math form, whose bmm's FlopCounterMode counts; `sdpa_flop_count` is its formula for the GPU kernels. Both
    # count every query head at full length, which is accounting's "full" mode.
    from torch.utils.flop_counter import sdpa_flop_count

    from stemlm.model import attention as attention_mod

    config = config_for(tiny_config, "stem", shape)
    model = build_model(config, device="meta").eval()
    B, T = 2, 12
    kv_heads_seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        kv_heads_seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(B, T, dtype=torch.long, device="meta"))
    assert counter.get_total_flops() == acc.prefill_flops(config, T, B, "full")
    gqa = config.kv_heads != config.num_attention_heads and attention_mod.SDPA_GQA
    assert kv_heads_seen == [(config.kv_heads if gqa else config.num_attention_heads, gqa)] * config.num_hidden_layers
    hd = config.head_size
    per_layer = sdpa_flop_count(
        (B, config.num_attention_heads, T, hd), (B, config.kv_heads, T, hd), (B, config.kv_heads, T, hd)
    )
    expected = acc.forward_flops_per_token(config, T, "full")["attn_scores"] * B * T
    assert per_layer * config.num_hidden_layers == expected


@pytest.mark.parametrize("kind", KINDS)
def test_decode_flops_equal_flop_counter(tiny_model, monkeypatch, kind):
    model = tiny_model(kind)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        cache = model(ids[:, :7], use_cache=True).past_key_values
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    total, _ = measure(model, ids[:, 7:], past_key_values=cache, use_cache=True)
    assert total == acc.decode_flops_per_token(model.config, 8)


def test_training_flops_are_three_forwards(tiny_config):
    config = tiny_config("stem")
    assert acc.training_flops_per_token(config, 64) == 3 * acc.forward_flops_per_token(config, 64)["total"]


def test_bad_arguments_are_user_errors(tiny_config):
    with pytest.raises(StemlmError, match="attention"):
        acc.forward_flops_per_token(tiny_config("stem"), 16, attention="sliding")
    with pytest.raises(StemlmError, match="positive"):
        acc.prefill_flops(tiny_config("stem"), 0)


# ----------------------------------------------------------------------------------------------------------
# decode memory traffic
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_params_touched_equal_nonzero_gradients(tiny_config, kind, shape):
    # The entries one new token's forward reads are those its output depends on: the nonzero gradient entries.
    # The MoE balancing loss is added so every router row (all are read to score the experts) gets a gradient.
    config = config_for(tiny_config, kind, shape, moe_shared_expert=kind == "moe")
    model = build_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 6))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).past_key_values
    out = model(ids[:, 5:], past_key_values=cache, use_cache=True)
    objective = (out.logits * torch.randn_like(out.logits)).sum()
    (objective + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    assert touched == acc.decode_params_touched(config)
    assert acc.decode_bytes_per_token(config, 0, dtype_bytes=2)["weights"] == 2 * touched


def test_kv_cache_bytes_equal_the_cache(tiny_model):
    model = tiny_model("stem")
    with torch.no_grad():
        cache = model(torch.randint(0, 256, (3, 11)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert acc.kv_cache_bytes(model.config, 11, dtype_bytes=4, batch_size=3) == held
    traffic = acc.decode_bytes_per_token(model.config, 11, dtype_bytes=2, kv_dtype_bytes=4)
    assert traffic["kv_cache"] == held // 3 and traffic["total"] == traffic["weights"] + held // 3


# ----------------------------------------------------------------------------------------------------------
# activated table parameters
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["stem", "stem_gate", "ple"])
def test_activated_table_parameters_equal_rows_read(tiny_model, kind):
    model = tiny_model(kind)
    tables = model.token_tables()
    ids = torch.tensor([[5, 9, 5, 200, 9, 9, 31], [5, 7, 7, 7, 1, 2, 3]])
    read: dict[int, set[int]] = {}

    def rows(layer_idx, input_ids):
        read.setdefault(layer_idx, set()).update(input_ids.reshape(-1).tolist())
        return tables[layer_idx](input_ids)

    with torch.no_grad():
        model(ids, rows={"token": rows})
    expected = sum(len(r) * tables[i].weight.shape[1] for i, r in read.items())
    assert acc.activated_table_parameters(model.config, ids) == expected
    width = tables[model.config.special_layers[0]].weight.shape[1]
    first = ids[0].tolist()  # one sequence, as a plain list: 4 distinct ids
    assert acc.activated_table_parameters(model.config, first) == len(tables) * width * 4


def test_activated_table_parameters_formula_and_errors(tiny_config):
    config = tiny_config("stem")  # |S| = 2 STEM layers, d_ff 128
    assert acc.activated_table_parameters(config, [[1, 2], [2, 3]]) == 2 * 128 * 3
    assert acc.activated_table_parameters(tiny_config("dense"), [1, 2, 3]) == 0
    with pytest.raises(StemlmError, match="256"):
        acc.activated_table_parameters(config, [1, 256])


# ----------------------------------------------------------------------------------------------------------
# STEM savings and the seed's closed form
# ----------------------------------------------------------------------------------------------------------
def test_seed_examples():
    assert acc.seed_saving_fraction(2048, 8192, 4096) == pytest.approx(0.20)
    assert round(acc.seed_saving_fraction(256, 1024, 256), 2) == 0.22


@pytest.mark.parametrize("d,d_ff,heads,L", [(2048, 8192, 16, 4096), (256, 1024, 4, 256), (64, 128, 4, 12)])
def test_layer_saving_reduces_to_seed_formula_with_mha_and_full_scores(tiny_config, d, d_ff, heads, L):
    config = tiny_config(
        "stem",
        hidden_size=d,
        intermediate_size=d_ff,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=L,
    )
    seed = acc.seed_saving_fraction(d, d_ff, L)
    assert acc.layer_saving_fraction(config, L, "full") == pytest.approx(seed, rel=1e-12)


def layer_flops_measured(model, ids, layer: int) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    return sum(counter.get_flop_counts()[f"StemLM.model.layers.{layer}"].values())


@pytest.mark.parametrize("kv", [4, 2])
def test_measured_layer_saving(tiny_model, monkeypatch, kv):
    # A STEM layer and its dense twin measured by FlopCounterMode (full scores): MHA gives the seed's fraction,
    # GQA a larger one (smaller k, v projections); the FLOPs saved are 2 * Delta F = 2 * B L d d_ff.
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)
    B, T = 2, 12
    ids = torch.randint(0, 256, (B, T))
    stem, dense = tiny_model("stem", num_key_value_heads=kv), tiny_model("dense", num_key_value_heads=kv)
    saved = layer_flops_measured(dense, ids, 1) - layer_flops_measured(stem, ids, 1)
    assert saved == 2 * acc.seed_flops_saved(B, T, 64, 128)
    fraction = saved / layer_flops_measured(dense, ids, 1)
    assert fraction == pytest.approx(acc.layer_saving_fraction(stem.config, T, "full"), rel=1e-12)
    seed = acc.seed_saving_fraction(64, 128, T)
    if kv == 4:
        assert fraction == pytest.approx(seed, rel=1e-12)
    else:
        assert fraction > seed


def test_layer_saving_needs_a_special_layer(tiny_config):
    with pytest.raises(StemlmError, match="no STEM"):
        acc.layer_saving_fraction(tiny_config("dense"), 16)


# ----------------------------------------------------------------------------------------------------------
# the paper's 1B figures
# ----------------------------------------------------------------------------------------------------------
def test_paper_1b_hypotheses():
    stem, dense = get_preset("paper-1b-counts"), get_preset("paper-1b-counts-dense")
    for config in (stem, dense):
        assert all(acc.paper_comparison(config)["reproduced"].values())
    # total = dense 1.50B + 5 tables of 128256 x 8192, the replaced up-projections not subtracted
    assert acc.paper_convention(stem)["total"] == acc.total_parameters(dense) + 5 * 128256 * 8192
    assert round(acc.total_parameters(stem) / 1e9, 2) == 6.67  # ours, subtracting them, differs
    # GFLOPs/token = 2 x active parameters; counting matmuls only plus attention scores does not give both numbers
    assert acc.paper_convention(stem)["gflops_per_token"] == 2 * acc.active_parameters(stem)["backbone"] / 1e9
    for L in (2048, 4096, 8192):
        for mode in acc.ATTENTION_MODES:
            pair = [round(acc.forward_flops_per_token(c, L, mode)["total"] / 1e9, 2) for c in (stem, dense)]
            assert pair != [2.83, 3.00]


def test_paper_comparison_only_for_the_paper_shape(tiny_config):
    assert acc.paper_comparison(tiny_config("stem")) is None
    counts = get_preset("paper-1b-counts")
    assert acc.paper_comparison(counts.replace(ffn_layers=[2, 5, 8, 11, 14]))["preset"] == "paper-1b-counts"
    assert acc.paper_comparison(counts.replace(intermediate_size=4096)) is None
    assert acc.paper_comparison(get_preset("paper-1b")) is None  # the official config is not the paper's table


def test_summarize_is_consistent(tiny_config):
    config = tiny_config("stem")
    s = acc.summarize(config, 64, dtype="fp32")
    assert s["parameters"]["total"] == sum(s["parameters"]["components"].values())
    assert s["flops"]["forward_per_sequence"] == 64 * s["flops"]["forward_per_token"]["total"]
    assert s["decode"]["bytes_per_token"]["weights"] == 4 * s["decode"]["params_touched"]
    assert "paper" not in s and s["stem"]["seed_saving_fraction"] == acc.seed_saving_fraction(64, 128, 64)
    with pytest.raises(StemlmError, match="dtype"):
        acc.summarize(config, 64, dtype="fp64")
