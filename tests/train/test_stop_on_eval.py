"""A stop (SIGINT) that lands on an evaluation step evaluates that step before it saves, so the stopped and resumed
run's metrics.jsonl holds every evaluation of the uninterrupted run, with the same numbers."""

from __future__ import annotations

import os
import signal

from stemlm.train.logging import read_metrics
from stemlm.train.trainer import Trainer


def evals(run):
    return [(r["step"], r["heldout_loss"]) for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]


def test_a_stop_on_an_eval_step_keeps_its_evaluation(tmp_path, make_train_config, make_model_config):
    def ctrl_c_at_10(step, loss):
        if step == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    config = make_model_config("stem")
    whole = Trainer(config, make_train_config(tmp_path / "a", eval_every=5), progress=False).fit()
    cfg = make_train_config(tmp_path / "b", eval_every=5)
    stopped = Trainer(config, cfg, fault_injection=ctrl_c_at_10, progress=False).fit()
    assert stopped["stopped_by"] == "SIGINT" and stopped["steps"] == 10
    assert [step for step, _ in evals(tmp_path / "b" / "run")] == [5, 10]
    Trainer.resume(tmp_path / "b" / "run", progress=False).fit()
    assert whole["steps"] == 20
    assert evals(tmp_path / "b" / "run") == evals(tmp_path / "a" / "run")
