"""Tests of the shared decoder parts and of cached decoding: RMSNorm, RoPE and grouped-query attention against
hand-written references, and KV-cache decoding (token by token, chunked, left-padded) against the full forward
for every FFN kind.
"""

from __future__ import annotations

import math

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model.attention import Attention, RMSNorm, RotaryEmbedding, apply_rope, build_attention_mask
from stemlm.model.config import FFN_KINDS


def test_rmsnorm_matches_formula():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8)
    expected = norm.weight * x / torch.sqrt((x * x).sum(-1, keepdim=True) / 8 + 1e-5)
    torch.testing.assert_close(norm(x), expected)


def test_rmsnorm_computes_fp64_in_fp64_and_half_types_in_fp32():
    norm = RMSNorm(64, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 64, dtype=torch.float64)
    expected = norm.weight * x / torch.sqrt((x * x).sum(-1, keepdim=True) / 64 + 1e-6)
    assert (norm(x) - expected).abs().max() < 1e-14  # fp32 arithmetic would be ~1e-7 off
    half = RMSNorm(64, eps=1e-6)  # fp32 weight, bf16 input: the whole product in fp32, the result fp32
    xb = torch.randn(5, 64).to(torch.bfloat16)
    through_fp32 = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert half(xb).dtype == torch.float32
    assert torch.equal(half(xb), half.weight * through_fp32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-5, None])
def test_half_precision_rmsnorm_equals_torchs(dtype, eps):
    """A bf16 / fp16 norm (weight and input in that dtype) is torch.nn.RMSNorm's: computed in fp32, weight included,
    and rounded once; rounding the normalised x before the weight as well put bf16 up to an ulp (3e-2) off."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=generator) * 3).to(dtype)
    weight = (torch.randn(256, generator=generator) * 2).to(dtype)
    ours, theirs = RMSNorm(256, eps=eps).to(dtype), torch.nn.RMSNorm(256, eps=eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    got, expected = ours(x), theirs(x)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    exact = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + (eps or torch.finfo(torch.float32).eps)) ** -0.5
    exact = exact * weight.double()
    info = torch.finfo(dtype)  # within an ulp of the exact value (subnormals: of the smallest normal)
    torch.testing.assert_close(got.double(), exact, rtol=info.eps, atol=info.tiny)


def test_rope_is_a_rotation_of_half_split_pairs():
    # Independent form: pair dimension i with i + hd/2 as a complex number and rotate it by pos * theta^(-2i/hd).
    hd, theta = 8, 10000.0
    rope = RotaryEmbedding(hd, theta)
    pos = torch.tensor([[0, 1, 5, 1000]])
    x = torch.randn(1, 2, 4, hd)
    cos, sin = rope(pos, torch.float32)
    got = apply_rope(x, cos, sin)
    freqs = torch.tensor([theta ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.float64)
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2 :].double())
    z = z * torch.polar(torch.ones(4, hd // 2, dtype=torch.float64), pos[0, :, None].double() * freqs)
    expected = torch.cat([z.real, z.imag], dim=-1).float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_rope_frequencies_stay_fp32_after_dtype_cast(tiny_model):
    model = tiny_model("dense").to(torch.bfloat16)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    fresh = RotaryEmbedding(model.config.head_size, model.config.rope_theta).inv_freq
    assert torch.equal(inv_freq, fresh)


def test_gqa_attention_matches_explicit_loop(tiny_config):
    config = tiny_config("dense", num_attention_heads=4, num_key_value_heads=2)
    attn = Attention(config, layer_idx=0)
    B, T, hd = 2, 6, config.head_size
    x = torch.randn(B, T, config.hidden_size)
    rope = RotaryEmbedding(hd, config.rope_theta)(torch.arange(T).expand(B, T), torch.float32)
    got = attn(x, rope, None, None)
    q = apply_rope(attn.q_proj(x).view(B, T, 4, hd).transpose(1, 2), *rope)
    k = apply_rope(attn.k_proj(x).view(B, T, 2, hd).transpose(1, 2), *rope)
    v = attn.v_proj(x).view(B, T, 2, hd).transpose(1, 2)
    heads = []
    for h in range(4):
        kv = h // 2  # query heads 0,1 share KV head 0; 2,3 share KV head 1
        scores = q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, kv])
    expected = attn.o_proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mask_hides_padding_and_future():
    mask = build_attention_mask(2, 1, torch.tensor([[0, 1, 1]]), torch.device("cpu"))
    assert mask.tolist() == [[[[False, True, False], [False, True, True]]]]


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_token_by_token_decoding_equals_full_forward(tiny_model, ffn):
    model = tiny_model(ffn)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    full = _logits(model, ids)
    out = model(ids[:, :1], use_cache=True)
    steps = [out.logits]
    for t in range(1, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert out.past_key_values.length == ids.shape[1]


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_chunked_prefill_after_cached_prefix(tiny_model, ffn):
    model = tiny_model(ffn)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    full = _logits(model, ids)
    with torch.no_grad():
        first = model(ids[:, :4], use_cache=True)
        second = model(ids[:, 4:9], past_key_values=first.past_key_values)
        third = model(ids[:, 9:], past_key_values=second.past_key_values)
    torch.testing.assert_close(torch.cat([first.logits, second.logits, third.logits], 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_left_padded_batch_matches_single_sequences(tiny_model, ffn):
    model = tiny_model(ffn)
    long_ids = torch.randint(1, model.config.vocab_size, (1, 7))
    short_ids = torch.randint(1, model.config.vocab_size, (1, 4))
    pad = 3
    batch = torch.cat([long_ids, torch.cat([torch.zeros(1, pad, dtype=torch.long), short_ids], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    got = _logits(model, batch, attention_mask=mask)
    torch.testing.assert_close(got[0], _logits(model, long_ids)[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, pad:], _logits(model, short_ids)[0], rtol=1e-4, atol=1e-5)
    # Then decode two more tokens with the cache, extending the padding mask each step.
    nxt = torch.randint(1, model.config.vocab_size, (2, 2))
    with torch.no_grad():
        out = model(batch, attention_mask=mask, use_cache=True)
        for t in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            out = model(nxt[:, t : t + 1], attention_mask=mask, past_key_values=out.past_key_values)
    torch.testing.assert_close(out.logits[1, -1], _logits(model, torch.cat([short_ids, nxt[1:]], 1))[0, -1])
    torch.testing.assert_close(out.logits[0, -1], _logits(model, torch.cat([long_ids, nxt[:1]], 1))[0, -1])


def test_crop_then_continue_equals_fresh(tiny_model):
    model = tiny_model("stem")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        out.past_key_values.crop(5)
        cont = model(ids[:, 5:], past_key_values=out.past_key_values)
    torch.testing.assert_close(cont.logits, _logits(model, ids)[:, 5:], rtol=1e-4, atol=1e-5)


def test_attention_mask_must_cover_cached_positions(tiny_model):
    model = tiny_model("dense")
    ids = torch.randint(0, model.config.vocab_size, (1, 4))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        with pytest.raises(StemlmError, match="attention_mask has shape"):
            model(ids[:, :1], attention_mask=torch.ones(1, 1), past_key_values=out.past_key_values)


def test_sdpa_gqa_equals_repeated_keys(monkeypatch):
    """`enable_gqa` (no repeated k/v copies) gives the logits of repeating k/v bitwise on CPU, and the gradients
    to 1e-6 (the k/v gradient is summed over the query heads in another order)."""
    from stemlm.model import attention as attention_mod
    from stemlm.model import build_model
    from stemlm.model.config import ModelConfig

    if not attention_mod.SDPA_GQA:
        pytest.skip("torch < 2.5 has no enable_gqa")
    shape = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, ffn="dense")
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, **shape)
    x = torch.randint(0, 64, (2, 12))
    results = []
    for gqa in (True, False):
        monkeypatch.setattr(attention_mod, "SDPA_GQA", gqa)
        model = build_model(cfg, seed=0)
        out = model(x, labels=x)
        out.loss.backward()
        results.append((out.logits, [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
