"""Fixtures of the benchmark tests: `dense_checkpoint`, a random dense model saved with the default tokenizer.

The retrofit benchmarks read a pretrained dense checkpoint (SmolLM2 in docs/results.md); a random one of the tiny
shape takes them through every step without the hub or the network. Its figures mean nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from tests.conftest import make_tiny_model


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory) -> Path:
    tokenizer = default_tokenizer()
    # The held-out text is scored in windows of up to 512 tokens (retrofit_layers), so positions reach 512.
    model = make_tiny_model(
        "dense", vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=2, max_position_embeddings=512
    )
    return save_pretrained(model, tmp_path_factory.mktemp("dense") / "ckpt", tokenizer=tokenizer)
