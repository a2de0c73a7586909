"""Fixtures for the analysis tests: a tiny STEM model with a vocabulary of 512 and a small BPE tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from stemlm.data.tokenizer import train_bpe
from stemlm.model import build_model

TEXT = " ".join(
    f"The capital of {c} is {k}. Country: {c}. Capital: {k}."
    for c, k in [("France", "Paris"), ("Spain", "Madrid"), ("Chile", "Santiago"), ("Peru", "Lima")]
)


@pytest.fixture(scope="session")
def _tok_json():
    return train_bpe([TEXT] * 30, vocab_size=360).to_str()


@pytest.fixture
def small_tokenizer(_tok_json):
    return Tokenizer.from_str(_tok_json)


@pytest.fixture
def analysis_model(tiny_config):
    def make(ffn: str = "stem", seed: int = 0, **overrides):
        return build_model(tiny_config(ffn, **{"vocab_size": 512, **overrides}), seed=seed).eval()

    return make
