"""loss.png's smoothed train curve: a trailing mean, checked against a direct computation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stemlm.train.logging import plot_losses, smoothed


def test_smoothed_is_the_trailing_mean():
    values = [5.0, 3.0, 4.0, 8.0, 1.0, 2.0, 7.0]
    expected = [np.mean(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
    assert smoothed(values, window=3) == pytest.approx(expected)


def test_loss_plot_draws_raw_and_smoothed_train_curves(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s, "loss": 6.0 - 0.01 * s} for s in range(1, 41)]
    records.append({"kind": "eval", "step": 40, "heldout_loss": 5.7})
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    png = plot_losses(metrics, tmp_path / "loss.png", title="t")
    assert png is not None and png.stat().st_size > 1000
