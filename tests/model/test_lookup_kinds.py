"""Tests of the lookup kinds `stem_ngram`, `engram` and `memory` against plain re-computations (python-integer
hashing, an explicit conv loop, a brute-force search over all product keys), KV-cache decoding against the
full forward (chunked, cropped and left-padded), save/load and Hugging Face Auto loading with generate().

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_lookup_kinds.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stemlm.model import TokenContext, build_model
from stemlm.model.ngram import INT64_MAX
from stemlm.model.ngram_layout import is_prime, ngram_layout
from tests.model.round_trip import assert_hf_generate_is_greedy

KINDS = ["stem_ngram", "engram", "memory"]
SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)


def config(tiny_config, kind, **extra):
    return tiny_config(kind, **{**SMALL, "stem_ngram_orders": "2,3", **extra})


def randomized(model, seed=0):
    """Every parameter random, so zero-initialised n-gram rows and small projections cannot hide a mistake."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model.eval()


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_ngram_ids(model, ids: list[int]) -> list[list[int]]:
    """Hash ids with python integers: XOR of (t_{-j}+1)·m_j over the n-gram, mod each head's prime, + offset."""
    h = model.ngram_hasher
    V, out = model.config.vocab_size, []
    for t in range(len(ids)):
        row, k = [], 0
        for n in h.orders:
            mix = 0
            for j in range(n):
                tok = ids[t - j] if t - j >= 0 else V
                mix ^= (tok + 1) * h.multipliers[j]
            for _ in range(h.heads):
                row.append(mix % h.sizes[k] + h.offsets[k])
                k += 1
        out.append(row)
    return out


def test_hash_ids_match_python_integers(tiny_config):
    model = build_model(config(tiny_config, "stem_ngram", stem_ngram_rows=50), device="meta")
    layout = ngram_layout(model.config)
    assert layout.sizes == (53, 59, 53, 59) and all(is_prime(p) for p in layout.sizes)
    assert max(model.ngram_hasher.multipliers) * (model.config.vocab_size + 1) <= INT64_MAX
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    got = model.ngram_hasher.ids(ids, torch.full((2, 2), -1))
    for b in range(2):
        assert got[b].tolist() == reference_ngram_ids(model, ids[b].tolist())
    # A position's ids depend on its last n tokens only: the same bigram elsewhere gets the same bigram ids.
    same = torch.tensor([[7, 1, 2, 9, 1, 2]])
    rows = model.ngram_hasher.ids(same, torch.full((1, 2), -1))[0]
    assert torch.equal(rows[2, :2], rows[5, :2]) and not torch.equal(rows[2, 2:], rows[5, 2:])


def test_stem_ngram_equals_plain_recomputation(tiny_config):
    model = randomized(build_model(config(tiny_config, "stem_ngram")))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 7, 64)
    layer = 1
    mlp = model.model.layers[layer].mlp
    ctx_out = {}
    mlp.register_forward_hook(lambda m, args, out: ctx_out.update(x=args[0], y=out))
    model(ids)
    x = ctx_out["x"]
    U, H = mlp.stem_embedding.weight, mlp.ngram_embedding.weight
    for b in range(2):
        keys = reference_ngram_ids(model, ids[b].tolist())
        for t in range(7):
            up = U[ids[b, t]] + sum(H[k] for k in keys[t])
            y = mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ x[b, t]) * up)
            torch.testing.assert_close(ctx_out["y"][b, t], y, atol=1e-4, rtol=1e-4)


def test_engram_equals_plain_recomputation(tiny_config):
    model = randomized(build_model(config(tiny_config, "engram")))
    eps = model.config.rms_norm_eps
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    mlp = model.model.layers[2].mlp
    seen = {}
    mlp.register_forward_hook(lambda m, args, out: seen.update(x=args[0][0], y=out[0]))
    model(ids)
    x, T, d = seen["x"], 14, 64
    keys = reference_ngram_ids(model, ids[0].tolist())
    E = mlp.engram_embedding.weight
    kernel, dil = model.config.engram_kernel, 3  # dilation = the largest order
    conv_w = mlp.engram_conv.weight[:, 0, :]  # [d, kernel]
    values, conv_in = [], []
    for t in range(T):
        e = torch.cat([E[k] for k in keys[t]])
        key = rms(mlp.engram_key_proj.weight @ e, mlp.engram_key_norm.weight, eps)
        q = rms(x[t], mlp.engram_query_norm.weight, eps)
        s = float((q @ key).detach()) / math.sqrt(d)
        gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(s), 1e-6)), s)))
        values.append(gate * (mlp.engram_value_proj.weight @ e))
        conv_in.append(rms(values[-1], mlp.engram_conv_norm.weight, eps))
    for t in range(T):
        conv = torch.zeros(d)
        for j in range(kernel):  # tap j reads position t - (kernel - 1 - j) * dilation
            src = t - (kernel - 1 - j) * dil
            if src >= 0:
                conv = conv + conv_w[:, j] * conv_in[src]
        dense = mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ x[t]) * (mlp.up_proj.weight @ x[t]))
        torch.testing.assert_close(seen["y"][t], dense + values[t] + F.silu(conv), atol=1e-4, rtol=1e-4)


def test_memory_equals_brute_force_over_all_product_keys(tiny_config):
    model = randomized(build_model(config(tiny_config, "memory")))
    mlp = model.model.layers[1].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = mlp(x[None], TokenContext(input_ids=torch.zeros(1, 5, dtype=torch.long)))[0]
    n, k, h = 16, 4, 2
    q = (mlp.memory_query.weight @ x.T).T.view(5, h, 2, 8)
    for i in range(5):
        memory = torch.zeros(64)
        for head in range(h):
            s1 = mlp.memory_keys[head, 0] @ q[i, head, 0]
            s2 = mlp.memory_keys[head, 1] @ q[i, head, 1]
            full = (s1[:, None] + s2[None, :]).flatten()  # every one of the n² product keys
            best, idx = full.topk(k)
            w = torch.softmax(best, 0)
            memory = memory + (w[:, None] * mlp.memory_values.weight[idx]).sum(0)
        y = mlp.memory_out.weight @ (memory * F.silu(mlp.memory_gate.weight @ x[i]))
        torch.testing.assert_close(out[i], y, atol=1e-4, rtol=1e-4)
    assert n * n == mlp.memory_values.weight.shape[0]


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_decoding_equals_full_forward(tiny_config, kind):
    model = randomized(build_model(config(tiny_config, kind)))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)  # prefill, then a chunk of 3, then one token at a time
        pieces, cache = [out.logits], out.past_key_values
        out = model(ids[:, 5:8], past_key_values=cache)
        pieces.append(out.logits)
        for t in range(8, 16):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
        # A cropped cache continues from the crop point (the decoding state is sliced to the cache length).
        cache.crop(6)
        again = model(ids[:, 6:9], past_key_values=cache).logits
        torch.testing.assert_close(again, full[:, 6:9], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["stem_ngram", "engram"])
def test_left_padding_is_no_token(tiny_config, kind):
    model = randomized(build_model(config(tiny_config, kind)))
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([torch.full((1, 3), 5), ids], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(ids).logits
        both = model(padded, attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_and_hf_generate(tmp_path, tiny_config, kind):
    model = randomized(build_model(config(tiny_config, kind)), seed=7)
    hf = assert_hf_generate_is_greedy(model, tmp_path / "ckpt")
    assert hf.config.model_type == "stemlm" and hf.config.ffn == kind
