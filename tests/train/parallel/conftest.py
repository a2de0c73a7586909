"""Fixtures for the distributed trainer tests: a small corpus, a 320-token BPE, and tiny model / run configs.

`dist_assets` writes six ~12k-character documents of the embedded corpus as text files and trains a byte-level
BPE on them once per session; token shards go to a session cache (STEMLM_CACHE, set by `dist_cache`).
`model_config(ffn)` is a 2-layer, hidden-64 model whose vocabulary of 333 rows is odd, so two ranks hold
unequal table shards (167 and 166 rows); `train_config(assets, out, **overrides)` is a 6-step run with a
global batch of 4 windows of 32 tokens, evaluated and checkpointed every 3 steps (Adam eps: see there).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stemlm.model.config import ModelConfig
from stemlm.train.config import TrainConfig
from stemlm.train.logging import read_metrics
from tests.small_corpus import SMALL_MODEL, write_small_corpus

VOCAB = 333


@pytest.fixture(scope="session")
def dist_assets(tmp_path_factory) -> dict[str, Path]:
    return write_small_corpus(tmp_path_factory.mktemp("dist_assets"))


@pytest.fixture
def dist_cache(dist_assets, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))


def model_config(ffn: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, **SMALL_MODEL, ffn=ffn)


def train_config(assets: dict[str, Path], out: Path, **overrides) -> TrainConfig:
    base = dict(
        data=[str(assets["data"])],
        tokenizer=str(assets["tokenizer"]),
        seq_len=32,
        batch_size=4,
        steps=6,
        lr=3e-3,
        # Adam divides by sqrt(v) + eps: a gradient entry that is float noise (a sum that cancels to ~1e-11, whose
        # sign depends on summation order) moves its weight by lr * g / eps. eps 1e-6 keeps that below 1e-6, so
        # 1 and 2 processes (different summation orders) can be compared at 1e-5; with 1e-8 single table
        # entries differed by 3e-4 while every loss still agreed to 1e-6.
        eps=1e-6,
        eval_every=3,
        eval_batches=2,
        save_every=3,
        keep_last=5,
        keep_optimizer_state="all",  # the tests resume from and compare the step-3 optimizer state
        out=str(out),
        device="cpu",
    )
    return TrainConfig(**{**base, **overrides})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fork_ranks(worker, root: Path, assets: dict[str, Path], world: int = 2) -> Path:
    """Run `worker(rank, world, port, root, assets)` on `world` forked gloo ranks (fork: the ranks inherit the
    imported modules; a fresh interpreter costs ~10 s on a loaded machine), token shards cached in `assets`."""
    import torch.multiprocessing as mp

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(assets["cache"]))
        mp.start_processes(worker, args=(world, free_port(), root, assets), nprocs=world, start_method="fork")
    return root


def records(run: Path) -> list[tuple]:
    """(kind, loss, held-out loss) of every metrics record of a run, for exact comparisons."""
    return [(r["kind"], r.get("loss"), r.get("heldout_loss")) for r in read_metrics(run / "metrics.jsonl")]
