"""The train progress bar: steps with an ETA, the loss, and the tokens/s of the last SPEED_STEPS steps; quiet
with progress off. Run: `python -m pytest tests/train/test_logging_bar.py -q`."""

from __future__ import annotations

import re

from stemlm.train.logging import SPEED_STEPS, RunLogger, read_metrics


def test_bar_shows_an_eta_and_the_windowed_tokens_per_s(tmp_path, tty_stderr):
    logger = RunLogger(tmp_path, 0, 50, progress=True)
    rates = [1000.0] * SPEED_STEPS + [100.0, 400.0]
    for rate in rates:
        logger.advance(5.0, rate)
    logger.close()
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    window = rates[-SPEED_STEPS:]  # 18 steps at 1000 tok/s, then 100 and 400: the tokens over the seconds
    assert f"loss 5.0000, {len(window) / sum(1 / r for r in window):,.0f} tok/s]" in last
    assert re.search(r"\| 22/50 steps \[\d\d:\d\d, ETA \d\d:\d\d, loss", last), last


def test_no_progress_writes_no_bar(tmp_path, capsys):
    logger = RunLogger(tmp_path, 0, 5, progress=False)
    logger.log({"kind": "train", "step": 1, "loss": 5.0, "tokens_per_s": 10.0})
    logger.advance(5.0, 10.0)
    logger.close()
    assert capsys.readouterr().err == ""
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"kind": "train", "step": 1, "loss": 5.0, "tokens_per_s": 10.0}]
