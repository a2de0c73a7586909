"""Fixtures for the evaluation tests: a tiny STEM model on the shipped tokenizer, saved as a checkpoint."""

from __future__ import annotations

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from stemlm.model.config import ModelConfig


def small_model(ffn: str = "stem", max_len: int = 96, seed: int = 0):
    tok = default_tokenizer()
    config = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_len,
        ffn_layers=[1],
        ffn=ffn,
        num_experts=4,
        ple_dim=8,
        initializer_range=0.1,
    )
    return build_model(config, seed=seed).eval(), tok


@pytest.fixture(scope="module")
def lm_and_tok():
    """(model, tokenizer): 2 layers, hidden 32, window 96, STEM in layer 1 (a wide init gives peaked logits)."""
    return small_model()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, lm_and_tok):
    model, tok = lm_and_tok
    return save_pretrained(model, tmp_path_factory.mktemp("eval") / "ckpt", tokenizer=tok)
