"""The spike check on the default data mix: a healthy run on corpus + facts (every batch holding its share of fact
windows, or a statement a line spread through the text) reports no loss spike, and a real one (a learning-rate
jump injected into the schedule) is reported.

With windows drawn from anywhere a batch held mostly facts or mostly corpus, its loss swung between the two kinds
of text, and the default run printed 28-39 spike lines while healthy (docs/results.md "The default run").
"""

from __future__ import annotations

import pytest

import stemlm.data.sources as sources
from stemlm.model.config import ModelConfig
from stemlm.train import optim
from stemlm.train.config import TrainConfig
from stemlm.train.trainer import Trainer

VERSE = "When in the chronicle of wasted time\nI see descriptions of the fairest wights,\n"
TEXTS = ([VERSE * 400, VERSE.upper() * 400, VERSE[::-1] * 400], [VERSE * 50])  # (train, held-out)


@pytest.fixture
def corpus(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "load_corpus", lambda data=None: TEXTS)  # stands in for the embedded corpus
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))


def spikes(tmp_path, name: str, layout: str = "batches") -> list[int]:
    from stemlm.train.logging import read_metrics

    model = ModelConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, ffn="stem"
    )
    cfg = TrainConfig(
        out=str(tmp_path / name),
        steps=60,
        seq_len=32,
        batch_size=4,
        eval_every=0,
        eval_batches=1,
        lr=3e-3,
        fact_fraction=0.3,
        fact_layout=layout,
        spike_window=20,
        device="cpu",
    )
    Trainer(model, cfg, progress=False).fit()
    return [r["step"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train" and r["spike"]]


@pytest.mark.parametrize("layout", ["batches", "lines"])
def test_a_healthy_run_on_the_fact_mix_reports_no_spike(corpus, tmp_path, layout):
    assert TrainConfig().fact_layout == "batches"
    assert spikes(tmp_path, "healthy", layout) == []


def test_a_learning_rate_jump_is_reported(corpus, tmp_path, monkeypatch):
    schedule = optim.lr_multiplier
    monkeypatch.setattr(optim, "lr_multiplier", lambda step, cfg: 300.0 if step == 44 else schedule(step, cfg))
    found = spikes(tmp_path, "jump")
    assert found and 45 <= found[0] <= 47  # the update after the jump (step 45 is the 1-based step of update 44)
