"""Shared test fixtures: a tiny config factory, a tiny model factory, one thread and fixed seeds.

`tiny_config(ffn="stem", **overrides)` gives a `ModelConfig` small enough for any CPU test (vocab 256,
hidden 64, 3 layers, 4 heads over 2 KV heads so grouped-query attention is always exercised, d_ff 128,
4 experts with top-2); `tiny_model(ffn, seed=0, **overrides)` builds it. `tty_stderr` makes the captured stderr
pass for a terminal, so the progress bars (drawn only on one, `stemlm.progress`) show. Run all tests with
`OMP_NUM_THREADS=1 python -m pytest tests -q`.
"""

from __future__ import annotations

import random

import pytest
import torch

from stemlm.model import StemLM, build_model
from stemlm.model.config import ModelConfig

# One thread: the machine is shared, and single-threaded kernels make float results reproducible run to run.
torch.set_num_threads(1)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    ffn_layers="all-but-first",
    num_experts=4,
    num_experts_per_tok=2,
    ple_dim=16,
)


def make_tiny_config(ffn: str = "stem", **overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, "ffn": ffn, **overrides})


def make_tiny_model(ffn: str = "stem", seed: int = 0, **overrides) -> StemLM:
    return build_model(make_tiny_config(ffn, **overrides), seed=seed).eval()


@pytest.fixture
def tiny_config():
    """Factory: `tiny_config(ffn="stem", **overrides) -> ModelConfig`."""
    return make_tiny_config


@pytest.fixture
def tiny_model():
    """Factory: `tiny_model(ffn="stem", seed=0, **overrides) -> StemLM` in eval mode."""
    return make_tiny_model


@pytest.fixture
def tty_stderr(capsys, monkeypatch):
    """capsys's stderr, reporting itself a terminal: progress bars are drawn into it. The class is patched, not
    the stream: pytest swaps capsys's stream in only when the test itself starts."""
    from _pytest.capture import CaptureIO

    monkeypatch.setattr(CaptureIO, "isatty", lambda self: True)
    return capsys


@pytest.fixture(autouse=True)
def _fixed_seeds():
    torch.manual_seed(0)
    random.seed(0)
