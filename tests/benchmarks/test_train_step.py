"""benchmarks/train_step.py at a toy shape: its RESULT line carries every field, with the shares and the loss
fraction computed from the figures it printed above it (a plain re-computation of the arithmetic, not a speed
test)."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields

bench = load_benchmark("train_step.py")

TOY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn-dim", "64", "--batch", "2", "--seq", "16"]


def test_result_line_and_its_arithmetic(capsys):
    bench.main([*TOY, "--stem-layers", "1", "--fused-chunk", "8", "--warmup", "1", "--reps", "2", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    fields = result_fields("\n".join(lines))
    assert set(fields) == {
        "stem_over_dense", "ours_over_hf", "predicted_stem_over_dense", "share_of_gemm", "stem_share_of_gemm",
        "loss_over_step", "fused_over_plain", "faults_per_step", "fused_faults_per_step",
    }  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in ("dense", "stem", "fused", "hf")}
    gemm = float(re.search(r"at the model's shapes ([\d.]+) GFLOP/s", "\n".join(lines)).group(1))
    for name, key in (("dense", "share_of_gemm"), ("stem", "stem_share_of_gemm")):
        gflops = float(rows[name][9])  # the table's GFLOP/s column, rounded to 0.1
        assert float(fields[key]) == pytest.approx(gflops / gemm, rel=0.05, abs=2e-3)
    # The printed milliseconds are rounded to 0.1 (the loss's can be 0.7 ms, so 7% off): the ratio must lie within
    # what the rounded numbers allow, plus the RESULT field's own rounding to 3 places.
    loss_ms = float(re.search(r"forward\+backward ([\d.]+) ms", "\n".join(lines)).group(1))
    step_ms = float(rows["dense"][3])
    low, high = (loss_ms - 0.05) / (step_ms + 0.05), (loss_ms + 0.05) / (step_ms - 0.05)
    assert low - 1e-3 <= float(fields["loss_over_step"]) <= high + 1e-3
    assert float(fields["fused_over_plain"]) == pytest.approx(
        float(rows["fused"][3]) / float(rows["dense"][3]), rel=0.05, abs=2e-3
    )
    assert int(fields["faults_per_step"]) >= 0 and int(fields["fused_faults_per_step"]) >= 0


@pytest.mark.slow
def test_compiled_trainers_join_the_rotation(capsys):
    bench.main([*TOY, "--stem-layers", "1", "--fused-chunk", "8", "--warmup", "1", "--reps", "1", "--threads", "1",
                "--compile"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    fields = result_fields("\n".join(lines))
    rows = {line.split()[0]: line.split() for line in lines}
    assert {"compiled", "compiled_fused"} <= set(rows)
    assert float(fields["compiled_over_plain"]) == pytest.approx(
        float(rows["compiled"][3]) / float(rows["dense"][3]), rel=0.05, abs=2e-3
    )
    assert float(fields["compiled_fused_over_plain"]) > 0 and float(fields["compiled_share_of_gemm"]) > 0
