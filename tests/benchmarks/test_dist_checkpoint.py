"""benchmarks/dist_checkpoint.py on 2 gloo processes with a small vocabulary: a save blocks training for part of
its whole time, and the checkpoint it waited for is on disk."""

from __future__ import annotations

import pytest

from tests.benchmarks.harness import result_fields, run_benchmark


@pytest.mark.dist
def test_blocking_share_of_a_save():
    out = run_benchmark("dist_checkpoint.py", "--saves", "1", "--vocab", "8192")
    fields = {k: float(v) for k, v in result_fields(out).items()}
    assert set(fields) == {"blocking_over_total", "blocking_s", "total_s", "checkpoint_mb"}
    assert 0 < fields["blocking_s"] <= fields["total_s"]
    assert fields["blocking_over_total"] == pytest.approx(fields["blocking_s"] / fields["total_s"], abs=2e-3)
    # the STEM table (8192 x 1024 fp32) and its two lazy_adamw moments alone are 100 MB
    assert fields["checkpoint_mb"] > 100
    assert out.count("save held training") == 2  # one line per rank
