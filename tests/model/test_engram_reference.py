"""`engram_variant="reference"` against an independent plain-torch recomputation of DeepSeek's Engram demo
(`engram_demo_v1.py`, read for its semantics): the hash indices (python integers, the demo's per-layer numpy draw of
the multipliers, its prime search with one set of taken primes, the pad id before the start, no + 1) exactly, the
branch and its place before attention to 1e-12 in fp64; KV-cache decoding, left padding, accounting against the
meta model and save/load (offload's refusal: tests/offload).

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_engram_reference.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from tests.model.test_accounting import math_attention
from tests.model.test_accounting_lookup import component_of

SMALL = dict(engram_dim=32, engram_heads=2, engram_rows=61, engram_variant="reference", engram_pad_id=3)
LAYOUTS = {  # the FFN kind on layers 1 and 2, or the branch beside STEM on layers 0 and 2
    "ffn": dict(ffn="engram", ffn_layers="1,2"),
    "beside": dict(ffn="stem", ffn_layers="all", engram_layers="0,2"),
}


def config(tiny_config, layout, **extra):
    return tiny_config(**{**LAYOUTS[layout], **SMALL, **extra})


def engram_layers(config) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if "engram" in config.layer_kinds(i)]


def randomized(model, seed=0):
    """Every parameter random (biases included), so a missing bias or a zero row cannot hide a mistake."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model.eval()


def branch_module(model, layer: int):
    block = model.model.layers[layer]
    return block.beside["engram"] if hasattr(block, "beside") else block.mlp


# ----------------------------------------------------------------------------------------------------------
# the demo's hashing, with python integers
# ----------------------------------------------------------------------------------------------------------
def plain_is_prime(n: int) -> bool:
    return n >= 2 and all(n % f for f in range(2, math.isqrt(n) + 1))


def demo_table_sizes(rows: int, orders: int, heads: int, layers: list[int]) -> dict[int, list[int]]:
    """For each layer, order, head: the first prime above the previous search start that no table took yet."""
    seen, sizes = set(), {}
    for layer in layers:
        sizes[layer] = []
        for _ in range(orders):
            start = rows - 1
            for _ in range(heads):
                candidate = start + 1
                while not plain_is_prime(candidate) or candidate in seen:
                    candidate += 1
                seen.add(candidate)
                sizes[layer].append(candidate)
                start = candidate
    return sizes


def demo_multipliers(vocab: int, seed: int, layer: int, max_order: int) -> list[int]:
    half_bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    drawn = np.random.default_rng(seed + 10007 * layer).integers(
        low=0, high=half_bound, size=(max_order,), dtype=np.int64
    )
    return [int(r) * 2 + 1 for r in drawn]


def demo_hash_ids(config, ids: list[int], layer: int) -> list[list[int]]:
    """Row ids into the layer's stacked table (its per-head offsets added, as the demo's MultiHeadEmbedding)."""
    orders = [int(n) for n in config.engram_orders.split(",")]
    sizes = demo_table_sizes(config.engram_rows, len(orders), config.engram_heads, engram_layers(config))[layer]
    mult = demo_multipliers(config.vocab_size, config.hash_seed, layer, max(orders))
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    out = []
    for t in range(len(ids)):
        row, k = [], 0
        for n in orders:
            mix = 0
            for j in range(n):
                tok = ids[t - j] if t - j >= 0 else config.engram_pad_id
                mix ^= tok * mult[j]
            for _ in range(config.engram_heads):
                row.append(mix % sizes[k] + offsets[k])
                k += 1
        out.append(row)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hash_ids_equal_the_demos(tiny_config, layout):
    cfg = config(tiny_config, layout, hash_seed=5)
    model = build_model(cfg, device="meta")
    layers = engram_layers(cfg)
    sizes = demo_table_sizes(cfg.engram_rows, 2, cfg.engram_heads, layers)
    assert len({p for s in sizes.values() for p in s}) == 4 * len(layers)  # a prime per (layer, order, head)
    for layer in layers:
        table = branch_module(model, layer).engram_embedding
        assert table.weight.shape[0] == sum(sizes[layer])
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    ids[0, 4] = cfg.engram_pad_id  # the pad id inside the sequence hashes as a position before the start does
    got = model.ngram_hasher.ids(ids, torch.full((2, 2), -1))
    assert sorted(got) == layers
    for layer in layers:
        for b in range(2):
            assert got[layer][b].tolist() == demo_hash_ids(cfg, ids[b].tolist(), layer)
    assert not torch.equal(got[layers[0]], got[layers[1]])  # per-layer multipliers and tables


# ----------------------------------------------------------------------------------------------------------
# the branch and where it enters, in fp64
# ----------------------------------------------------------------------------------------------------------
def demo_rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def demo_branch(module, x, hash_ids, config):
    """The demo's Engram forward with one hyper-connection stream: gate, value, value + silu(short conv)."""
    d = x.shape[-1]
    embeddings = module.engram_embedding.weight[hash_ids].flatten(-2)
    key = embeddings @ module.engram_key_proj.weight.T + module.engram_key_proj.bias
    eps = torch.finfo(x.dtype).eps  # nn.RMSNorm(eps=None)
    normed_key = demo_rms(key, module.engram_key_norm.weight, eps)
    normed_query = demo_rms(x, module.engram_query_norm.weight, eps)
    gate = (normed_key * normed_query).sum(-1) / math.sqrt(d)
    gate = (gate.abs().clamp_min(1e-6).sqrt() * gate.sign()).sigmoid().unsqueeze(-1)
    value = gate * (embeddings @ module.engram_value_proj.weight.T + module.engram_value_proj.bias)
    normed = demo_rms(value, module.engram_conv_norm.weight, 1e-5)  # ShortConv's norm_eps
    kernel, dilation = config.engram_kernel, 3  # dilation: the largest order
    y = F.conv1d(
        normed.transpose(1, 2), module.engram_conv.weight, padding=(kernel - 1) * dilation, dilation=dilation, groups=d
    )
    return value + F.silu(y[..., : x.shape[1]]).transpose(1, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_branch_before_attention_equals_the_demo_in_fp64(tiny_config, layout):
    cfg = config(tiny_config, layout)
    model = randomized(build_model(cfg)).to(torch.float64)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    calls, hooks = {}, []
    for layer in engram_layers(cfg):
        block = model.model.layers[layer]
        hooks.append(block.register_forward_pre_hook(lambda m, args, i=layer: calls.update({i: {"args": args}})))
        hooks.append(block.register_forward_hook(lambda m, args, out, i=layer: calls[i].update(out=out)))
    with torch.no_grad():
        model(ids)
        for hook in hooks:  # removed, so the re-run of a layer below records nothing over the model's own outputs
            hook.remove()
        for layer in engram_layers(cfg):
            block, (x, *rest) = model.model.layers[layer], calls[layer]["args"]
            hash_ids = torch.tensor([demo_hash_ids(cfg, row, layer) for row in ids.tolist()])
            after = x + demo_branch(branch_module(model, layer), x, hash_ids, cfg)
            # The rest of the layer (attention, then the FFN position without the branch) runs on x + branch.
            block.acts_on_residual, block.residual_sides = False, ()
            expected = block(after, *rest)
            assert (calls[layer]["out"] - expected).abs().max().item() <= 1e-12


# ----------------------------------------------------------------------------------------------------------
# decoding, padding, accounting, checkpoints, offload
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_cache_decoding_and_left_padding_equal_the_full_forward(tiny_config, layout):
    model = randomized(build_model(config(tiny_config, layout)))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        pieces.append(model(ids[:, 5:8], past_key_values=cache).logits)
        for t in range(8, 16):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
        padded = torch.cat([torch.full((2, 3), 7), ids], 1)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 16, dtype=torch.long)], 1)
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 3:], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameter_counts_match_the_meta_model(tiny_config, layout):
    cfg = config(tiny_config, layout, num_hidden_layers=4)
    model = build_model(cfg, device="meta")
    measured = dict.fromkeys(acc.PARAM_COMPONENTS, 0)
    for name, p in model.named_parameters():
        name = name.replace(".beside.engram.", ".mlp.")  # the side module's parameters count as the kind's
        component = "engram_bias" if name.endswith("_proj.bias") else component_of(name, cfg)
        if component == "ffn_dense" and cfg.layer_ffn(int(name.split(".")[2])) == "stem":
            component = "stem_proj"  # STEM's gate and down projections (the beside layout)
        measured[component] += p.numel()
    assert acc.parameter_counts(cfg) == measured
    assert acc.total_parameters(cfg) == model.num_parameters()


def test_flops_and_decode_params_touched_equal_the_measured(tiny_config, monkeypatch):
    cfg = config(tiny_config, "ffn", num_hidden_layers=4)
    monkeypatch.setattr(F, "scaled_dot_product_attention", math_attention)  # attention's FLOPs counted too
    model = randomized(build_model(cfg))
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids[:, :12])
    assert counter.get_total_flops() == acc.prefill_flops(cfg, 12, 1, "full")
    with torch.no_grad():
        cache = model(ids[:, :13], use_cache=True).past_key_values
    out = model(ids[:, 13:], past_key_values=cache)
    (out.logits * torch.randn_like(out.logits)).sum().backward()
    touched = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    assert touched == acc.decode_params_touched(cfg)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_load_keeps_the_variant(tmp_path, tiny_config, layout):
    model = randomized(build_model(config(tiny_config, layout)), seed=7)
    save_pretrained(model, tmp_path / "ckpt")
    loaded = from_pretrained(tmp_path / "ckpt")
    assert loaded.config.engram_variant == "reference" and loaded.config.engram_pad_id == 3
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_bad_variant_and_pad_id_are_config_errors():
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(StemlmError, match="engram_variant"):
        ModelConfig(**base, ffn="engram", engram_variant="demo")
    with pytest.raises(StemlmError, match="engram_pad_id"):
        ModelConfig(**base, ffn="engram", engram_variant="reference", engram_pad_id=256)
