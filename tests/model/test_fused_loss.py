"""The fused lm_head + cross-entropy against the plain `lm_head` + `F.cross_entropy`: loss and gradients to 1e-6
in fp32 (ignored labels, tied weights, odd chunks, a chunk larger than the input), within bf16 rounding under
autocast, and no [tokens, V] tensor saved for backward; the workspace reused across chunks and calls gives the
results of fresh buffers bitwise.

Run: `python -m pytest tests/model/test_fused_loss.py -q`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stemlm.model.fused_loss as fused_loss
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.decoder import ForwardOptions
from stemlm.model.fused_loss import fused_linear_cross_entropy
from stemlm.model.loss import IGNORE_INDEX
from tests.model.test_loss import VOCAB, config

N, D = 96, 32  # more tokens than hidden units, so a [V, D] gradient is smaller than any [N, V] tensor


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen)
    weight = torch.randn(VOCAB, D, generator=gen) * 0.5
    labels = torch.randint(0, VOCAB, (N,), generator=gen)
    labels[::5] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    (3.0 * loss).backward()  # a non-unit upstream gradient, as grad_accum and loss weights give
    return loss.detach(), h.grad, w.grad


def plain(h, w, labels):
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 7, 32, 95, 96, 1000])
def test_fused_equals_plain_fp32(chunk):
    hidden, weight, labels = inputs()
    want = loss_and_grads(plain, hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_fused_under_bf16_autocast_within_bf16_rounding():
    # Both paths run the head's matmuls in bf16 (8 mantissa bits, ~4e-3 relative); the fused one sums d(weight)
    # over chunks in fp32 where the plain one rounds a single bf16 product, so they agree to bf16 rounding only.
    hidden, weight, labels = inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(plain, hidden, weight, labels)
        got = loss_and_grads(lambda h, w, y: fused_linear_cross_entropy(h, w, y, 17), hidden, weight, labels)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=name)


def test_no_tokens_by_vocab_tensor_saved():
    hidden, weight, labels = inputs()
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    for fn in (plain, lambda h, w, y: fused_linear_cross_entropy(h, w, y, 16)):
        sizes.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), labels)
        largest = max(sizes)
        if fn is plain:
            assert largest >= N * VOCAB  # the plain loss keeps the logits (or log-probs) for backward ...
        else:
            assert largest == VOCAB * D < N * VOCAB  # ... the fused one only its d(weight) and d(hidden)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_reused_workspace_gives_the_results_of_fresh_buffers_bitwise(autocast):
    # A larger call first leaves its numbers in the thread's workspace; the calls after it must not see them.
    def fused(h, w, y):
        return fused_linear_cross_entropy(h, w, y, 13)

    hidden, weight, labels = inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused_loss.release_workspace()
        fresh = loss_and_grads(fused, hidden, weight, labels)
        loss_and_grads(lambda h, w, y: fused_linear_cross_entropy(h, w, y, 40), *inputs(3))
        workspace = fused_loss._WORKSPACE.buffers[hidden.device]
        again = [loss_and_grads(fused, hidden, weight, labels) for _ in range(2)]
    assert fused_loss._WORKSPACE.buffers[hidden.device] is workspace  # no new buffer per chunk or per call
    for got in again:
        for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, fresh, strict=True):
            assert torch.equal(a, b), name


def test_no_grad_and_frozen_weight():
    hidden, weight, labels = inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            fused_linear_cross_entropy(hidden, weight, labels, 10), plain(hidden, weight, labels)
        )
    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(h, weight, labels, 10).backward()  # the head frozen: only d(hidden) is formed
    want = hidden.clone().requires_grad_()
    plain(want, weight, labels).backward()
    torch.testing.assert_close(h.grad, want.grad, rtol=1e-6, atol=1e-6)


def test_all_ignored_labels_give_nan_loss_and_zero_grads():
    hidden, weight, _ = inputs()
    loss, d_hidden, d_weight = loss_and_grads(
        lambda h, w, y: fused_linear_cross_entropy(h, w, y, 8), hidden, weight, torch.full((N,), IGNORE_INDEX)
    )
    assert loss.isnan() and not d_hidden.any() and not d_weight.any()


def model_loss_grads(cfg, x, y, **kw):
    model = build_model(cfg, seed=0).train()
    out = model(x, labels=y, options=ForwardOptions(**kw))
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [5, 1000])
def test_model_fused_loss_equals_full_loss(tied, chunk):
    cfg = config(tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    y[1, 3:9] = IGNORE_INDEX
    full, full_grads = model_loss_grads(cfg, x, y)
    fused, fused_grads = model_loss_grads(cfg, x, y, loss_chunk=chunk, fused_loss=True)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, full.loss, rtol=1e-6, atol=1e-6)
    assert fused_grads.keys() == full_grads.keys()  # a tied head is one parameter in both
    for name, grad in full_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_model_fused_loss_under_bf16_autocast():
    cfg = config(tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, full_grads = model_loss_grads(cfg, x, y)
        fused, fused_grads = model_loss_grads(cfg, x, y, loss_chunk=9, fused_loss=True)
    torch.testing.assert_close(fused.loss, full.loss, rtol=1e-2, atol=0)  # bf16 logits: 8 mantissa bits
    for name, grad in full_grads.items():
        assert fused_grads[name].dtype == grad.dtype == torch.float32, name
        torch.testing.assert_close(fused_grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)


def test_fused_loss_without_chunk_is_an_error():
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(StemlmError, match="fused_loss needs loss_chunk"):
        build_model(config(), seed=0)(x, labels=x, options=ForwardOptions(fused_loss=True))
