"""Achieved model FLOP/s and the matmul peak of the train summary, against counts made here.

Run: `python -m pytest tests/train/test_throughput.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.model.presets import get_preset
from stemlm.train.throughput import matmul_peak, matmul_shapes, training_throughput


def test_matmul_shapes_of_the_tiny_preset():
    # tiny: d 256, 4 heads x 64 (no GQA), d_ff 768, V 8192: q/k/v/o are all 256 x 256.
    assert matmul_shapes(get_preset("tiny"), 512) == [
        (512, 256, 256),
        (512, 256, 768),
        (512, 256, 8192),
        (512, 768, 256),
    ]


def test_peak_is_the_best_of_the_timed_matmuls(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("stemlm.train.throughput.time.perf_counter", lambda: next(clock))
    # Every timed call then lasts exactly 1 s, so the peak is the largest 2 M K N.
    assert matmul_peak([(4, 8, 16), (8, 8, 8)], torch.device("cpu"), reps=2) == 2 * 4 * 8 * 16


def test_training_throughput_relates_achieved_to_peak(monkeypatch):
    monkeypatch.setattr("stemlm.train.throughput.matmul_peak", lambda shapes, device, dtype: 50e9)
    config = get_preset("tiny")
    out = training_throughput(config, 256, 1000.0, 2048, torch.device("cpu"), world_size=2)
    # Training FLOPs per token, independently: 3 x forward; forward = 2 x matmul weights + causal attention scores.
    d, f, V, L, seq = 256, 768, 8192, 4, 256
    weights = L * 4 * d * d + 2 * (2 * d * f) + 2 * (3 * d * f) + d * V  # STEM in layers 1, 3: gate + down only
    scores = L * 4 * d * (seq + 1) / 2
    flops = 3 * (2 * weights + scores)
    assert out["model_gflops_per_s"] == pytest.approx(flops * 1000 / 1e9)
    assert out["matmul_peak_gflops_per_s"] == pytest.approx(100.0)
    assert out["peak_share"] == pytest.approx(flops * 1000 / 100e9)
