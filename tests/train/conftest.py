"""Fixtures for the trainer tests: a small user corpus, a 320-token BPE trained on it, and config factories.

`train_assets` writes six ~12k-character documents of the embedded corpus as text files (so the data layer
splits one off as held-out) and trains a byte-level BPE with vocabulary 320 on them, once per session.
`make_train_config(tmp_path, **overrides)` and `make_model_config(ffn, **overrides)` give a run that takes about
a second: hidden 64, 2 layers, seq_len 32, batch 4; `changed_fields(cfg)` lists what such a config sets. Token
shards go to a per-session cache folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stemlm.model.config import ModelConfig
from stemlm.train.config import TrainConfig
from tests.small_corpus import SMALL_MODEL, write_small_corpus
from tests.small_corpus import TOKENIZER_VOCAB as VOCAB


@pytest.fixture(scope="session")
def train_assets(tmp_path_factory) -> dict[str, Path]:
    return write_small_corpus(tmp_path_factory.mktemp("train_assets"))


@pytest.fixture(autouse=True)
def _token_cache(train_assets, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(train_assets["cache"]))


@pytest.fixture
def make_train_config(train_assets):
    def make(tmp_path: Path, **overrides) -> TrainConfig:
        base = dict(
            data=[str(train_assets["data"])],
            tokenizer=str(train_assets["tokenizer"]),
            seq_len=32,
            batch_size=4,
            steps=20,
            lr=3e-3,
            eval_every=10,
            eval_batches=2,
            out=str(tmp_path / "run"),
            device="cpu",
        )
        return TrainConfig(**{**base, **overrides})

    return make


@pytest.fixture
def make_model_config():
    def make(ffn: str = "stem", **overrides) -> ModelConfig:
        base = dict(
            vocab_size=VOCAB,
            **SMALL_MODEL,
            ffn=ffn,
            num_experts=4,
            num_experts_per_tok=2,
            ple_dim=16,
        )
        return ModelConfig(**{**base, **overrides})

    return make


def changed_fields(cfg: TrainConfig) -> dict:
    """The fields of `cfg` away from the defaults, as a command line gives them (e.g. to `recipes.train_config`)."""
    defaults = TrainConfig().to_dict()
    return {k: v for k, v in cfg.to_dict().items() if v != defaults[k]}
