"""The per-step log: each train record carries the model FLOP/s of its step (accounting's training FLOPs per
token times the step's tokens/s), and the eval lines show it.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_step_log.py -q`.
"""

from __future__ import annotations

import pytest

from stemlm.model.accounting import training_flops_per_token
from stemlm.train.trainer import Trainer
from tests.train.test_trainer import train_records


def test_model_gflops_per_step(tmp_path, make_train_config, make_model_config, capsys):
    config = make_model_config("stem")
    cfg = make_train_config(tmp_path, steps=2, eval_every=2)
    Trainer(config, cfg, progress=False).fit()
    per_token = training_flops_per_token(config, cfg.seq_len)
    for record in train_records(tmp_path / "run"):
        assert record["model_gflops_per_s"] == pytest.approx(per_token * record["tokens_per_s"] / 1e9, rel=1e-12)
    assert " GFLOP/s | skipped" in capsys.readouterr().err
