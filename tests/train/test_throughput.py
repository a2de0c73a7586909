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


def test_peak_is_the_best_of_the_timed_matmuls_in_each_clock(monkeypatch):
    wall, cpu = iter(float(t) for t in range(1000)), iter(float(t) for t in range(0, 2000, 2))
    monkeypatch.setattr("stemlm.train.throughput.time.perf_counter", lambda: next(wall))
    monkeypatch.setattr("stemlm.train.throughput.time.process_time", lambda: next(cpu))
    # Every timed call then lasts exactly 1 wall second and 2 CPU seconds, so each peak is the largest 2 M K N
    # over its clock's seconds.
    peak = matmul_peak([(4, 8, 16), (8, 8, 8)], torch.device("cpu"), reps=2)
    assert peak == {"wall": 2 * 4 * 8 * 16, "cpu": 2 * 4 * 8 * 16 / 2}


def test_a_clock_too_coarse_for_one_matmul_gives_no_peak(monkeypatch):
    monkeypatch.setattr("stemlm.train.throughput.time.process_time", lambda: 5.0)
    assert matmul_peak([(4, 8, 16)], torch.device("cpu"), reps=2)["cpu"] == 0.0


def tiny_training_flops(seq: int) -> float:
    """Training FLOPs per token, independently: 3 x forward; forward = 2 x matmul weights + causal attention scores."""
    d, f, V, L = 256, 768, 8192, 4
    weights = L * 4 * d * d + L * (2 * d * f) + d * V  # STEM in every layer: gate + down only
    scores = L * 4 * d * (seq + 1) / 2
    return 3 * (2 * weights + scores)


def test_training_throughput_relates_each_clock_to_its_peak(monkeypatch):
    peak = {"wall": 50e9, "cpu": 40e9}
    monkeypatch.setattr("stemlm.train.throughput.matmul_peak", lambda shapes, device, dtype: peak)
    out = training_throughput(get_preset("tiny"), 256, 1000.0, 600.0, 2048, torch.device("cpu"), world_size=2)
    flops = tiny_training_flops(256)
    assert out["model_gflops_per_s"] == pytest.approx(flops * 1000 / 1e9)
    assert out["matmul_peak_gflops_per_s"] == pytest.approx(100.0)
    assert out["peak_share"] == pytest.approx(flops * 1000 / 100e9)
    # 600 tokens per CPU-second of rank 0, which trained half of them: 300 tokens per CPU-second of one process.
    assert out["model_gflops_per_cpu_s"] == pytest.approx(flops * 300 / 1e9)
    assert out["matmul_peak_gflops_per_cpu_s"] == pytest.approx(40.0)
    assert out["cpu_peak_share"] == pytest.approx(flops * 300 / 40e9)


def test_no_cpu_time_figures_off_the_cpu_or_without_cpu_time(monkeypatch):
    monkeypatch.setattr("stemlm.train.throughput.matmul_peak", lambda shapes, device, dtype: {"wall": 1e9, "cpu": 1e9})
    config = get_preset("tiny")
    assert "cpu_peak_share" not in training_throughput(config, 256, 10.0, None, 64, torch.device("cpu"))
    assert "cpu_peak_share" not in training_throughput(config, 256, 10.0, 5.0, 64, torch.device("meta"))
