"""Tests of the routed baselines (`stemlm.model.kinds.moe`, `stemlm.model.kinds.hash_moe`): dropless dispatch
against a naive per-token loop, the balancing and z-losses against their formulas, and the hash assignment's
balance and seeding."""

from __future__ import annotations

import math

import pytest
import torch

from stemlm.model import build_model
from stemlm.model.ffn import TokenContext
from stemlm.model.kinds.hash_moe import HashMoEFFN, balanced_hash
from stemlm.model.kinds.moe import MoEFFN, load_balancing_loss


def _expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    h = x @ experts.gate_proj[e].T
    return (h * torch.sigmoid(h) * (x @ experts.up_proj[e].T)) @ experts.down_proj[e].T


def _moe(config, **kw) -> MoEFFN:
    ffn = MoEFFN(config.replace(**kw), layer_idx=1)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_(0, 0.3)
    return ffn.requires_grad_(False)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_dispatch_equals_naive_loop(tiny_config, shared, k):
    config = tiny_config("moe")
    ffn = _moe(config, moe_shared_expert=shared, num_experts_per_tok=k)
    x = torch.randn(2, 7, config.hidden_size)
    ctx = TokenContext(torch.zeros(2, 7, dtype=torch.long))
    got = ffn(x, ctx)
    expected, counts = [], torch.zeros(config.num_experts, dtype=torch.long)
    for token in x.reshape(-1, config.hidden_size):
        probs = (token @ ffn.router.weight.T).softmax(-1)
        chosen = sorted(range(config.num_experts), key=lambda e: -float(probs[e]))[:k]
        total = sum(float(probs[e]) for e in chosen)
        y = sum(float(probs[e]) / total * _expert(ffn.experts, e, token) for e in chosen)
        if shared:
            s = ffn.shared_expert
            y = y + s.down_proj(torch.nn.functional.silu(s.gate_proj(token)) * s.up_proj(token))
        expected.append(y)
        counts[chosen] += 1
    torch.testing.assert_close(got, torch.stack(expected).reshape(x.shape), rtol=1e-4, atol=1e-5)
    assert torch.equal(ctx.expert_counts[1], counts)
    assert int(ctx.expert_counts[1].sum()) == x.shape[0] * x.shape[1] * k


def test_aux_loss_is_one_for_uniform_router(tiny_config):
    config = tiny_config("moe")
    ffn = _moe(config)
    with torch.no_grad():
        ffn.router.weight.zero_()
    ctx = TokenContext(torch.zeros(3, 5, dtype=torch.long))
    ffn(torch.randn(3, 5, config.hidden_size), ctx)
    # Zero router weights make every prob exactly 1/E. top-k then breaks ties the same way for every token, so the
    # counts are NOT uniform, but the loss does not depend on them: E * sum_e f_e * (1/E) = sum_e f_e = 1.
    assert ctx.expert_counts[1].max() == 15  # all tokens went to the same k experts
    assert abs(float(ctx.aux_losses[0]) - 1.0) < 1e-6
    # Uniform counts with any probs also give exactly 1 (the mean probs sum to 1).
    probs = torch.randn(12, 4).softmax(-1)
    assert abs(float(load_balancing_loss(probs, torch.full((4,), 6))) - 1.0) < 1e-6


def test_aux_loss_formula_and_skew(tiny_config):
    config = tiny_config("moe")
    ffn = _moe(config)
    with torch.no_grad():
        ffn.router.weight[0] = 2.0  # expert 0 wins for tokens with positive coordinates
    x = torch.rand(2, 6, config.hidden_size)
    ctx = TokenContext(torch.zeros(2, 6, dtype=torch.long))
    ffn(x, ctx)
    flat = x.reshape(-1, config.hidden_size).double()
    probs = (flat @ ffn.router.weight.double().T).softmax(-1)
    counts = ctx.expert_counts[1].double()
    E, N, k = config.num_experts, flat.shape[0], config.num_experts_per_tok
    expected = E * sum(float(counts[e]) / (N * k) * float(probs[:, e].mean()) for e in range(E))
    assert counts[0] == N  # every token picked expert 0
    assert float(ctx.aux_losses[0]) == pytest.approx(expected, rel=1e-5)
    assert expected > 1.5


def test_z_loss_formula(tiny_config):
    config = tiny_config("moe")
    ffn = _moe(config, router_z_loss=True)
    x = torch.randn(2, 5, config.hidden_size)
    ctx = TokenContext(torch.zeros(2, 5, dtype=torch.long))
    ffn(x, ctx)
    assert len(ctx.aux_losses) == 2
    logits = x.reshape(-1, config.hidden_size).double() @ ffn.router.weight.double().T
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / logits.shape[0]
    assert float(ctx.aux_losses[1]) == pytest.approx(expected, rel=1e-5)


def test_router_gets_gradients_from_lm_and_aux_loss(tiny_model):
    model = tiny_model("moe").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()
    for i in model.config.special_layers:
        assert model.model.layers[i].mlp.router.weight.grad.abs().sum() > 0
    assert sorted(out.expert_counts) == model.config.special_layers


def test_balanced_hash_sizes_and_seeds():
    a = balanced_hash(1001, 8, seed=3)
    sizes = torch.bincount(a, minlength=8)
    assert int(sizes.max() - sizes.min()) <= 1 and int(sizes.sum()) == 1001
    assert torch.equal(a, balanced_hash(1001, 8, seed=3))
    assert not torch.equal(a, balanced_hash(1001, 8, seed=4))


def test_hash_moe_equals_naive_loop(tiny_config):
    config = tiny_config("hash_moe")
    ffn = HashMoEFFN(config, layer_idx=2)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 6, config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (2, 6))
    ctx = TokenContext(ids)
    got = ffn(x, ctx)
    table = balanced_hash(config.vocab_size, config.num_experts, config.hash_seed + 2)
    expected = torch.stack(
        [torch.stack([_expert(ffn.experts, int(table[ids[b, t]]), x[b, t]) for t in range(6)]) for b in range(2)]
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(ctx.expert_counts[2], torch.bincount(table[ids.reshape(-1)], minlength=config.num_experts))


def test_hash_map_survives_meta_build_and_differs_per_layer(tiny_config):
    model = build_model(tiny_config("hash_moe", hash_seed=11))
    layers = model.config.special_layers
    for i in layers:
        expected = balanced_hash(model.config.vocab_size, model.config.num_experts, 11 + i)
        assert torch.equal(model.model.layers[i].mlp.expert_of_token, expected)
    first, second = (model.model.layers[i].mlp.expert_of_token for i in layers[:2])
    assert not torch.equal(first, second)
