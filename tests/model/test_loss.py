"""The chunked lm_head + cross-entropy: the same loss and gradients as the full-logits loss (1e-6), with no
[tokens, vocab] logits tensor kept for backward.

Run: `python -m pytest tests/model/test_loss.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import ForwardOptions

VOCAB = 300


def config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, ffn="stem", ffn_layers="odd",
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


def loss_grads_saved(cfg: ModelConfig, chunk: int, x, y):
    model = build_model(cfg, seed=0).train()
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, labels=y, options=ForwardOptions(loss_chunk=chunk))
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_chunked_loss_equals_full_loss(tied, chunk):
    cfg = config(tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen)
    y[0, :5] = -100  # ignored positions count in neither the sum nor the mean's denominator
    full, full_grads, full_saved = loss_grads_saved(cfg, 0, x, y)
    part, part_grads, part_saved = loss_grads_saved(cfg, chunk, x, y)
    assert part.logits is None and full.logits.shape == (2, 16, VOCAB)
    torch.testing.assert_close(part.loss, full.loss, rtol=1e-6, atol=1e-6)
    for name, grad in full_grads.items():
        torch.testing.assert_close(part_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)

    def logits_like(shapes):  # a saved tensor with a vocabulary axis over every token: the full logits
        return [s for s in shapes if s and s[-1] == VOCAB and torch.Size(s).numel() >= 32 * VOCAB]

    assert logits_like(full_saved)  # the plain loss keeps [tokens, V] logits for backward ...
    assert not logits_like(part_saved)  # ... the chunked one does not


def test_all_ignored_labels_give_nan_as_before():
    x = torch.zeros(1, 4, dtype=torch.long)
    y = torch.full((1, 4), -100)
    model = build_model(config(), seed=0)
    assert model(x, labels=y).loss.isnan() and model(x, labels=y, options=ForwardOptions(loss_chunk=2)).loss.isnan()
