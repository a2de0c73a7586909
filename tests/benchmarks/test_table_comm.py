"""benchmarks/table_comm.py on 2 gloo processes at a toy batch: the row-sharded bytes against the analytic d_ff
split (whose formula is re-computed here from the printed shape), and `--exchange`, whose host-planned exchange
calls fewer collectives per step than the collective plan it replaced."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.harness import result_fields, run_benchmark


@pytest.mark.dist
def test_sharded_bytes_against_the_official_split():
    out = run_benchmark("table_comm.py", "--batch", "2", "--seq", "16", "--steps", "1")
    local, seq, layers, d_ff = map(
        int, re.search(r"(\d+)x(\d+) tokens per rank, (\d+) tables of width (\d+)", out).groups()
    )
    sharded, official = (
        int(x.replace(",", ""))
        for x in re.search(r"sharded: ([\d,]+) B/rank/step; .*: ([\d,]+) B/rank/step", out).groups()
    )
    # ids all-gathered (int64), then the fp32 activations all-to-all'd forward and their gradients backward
    assert official == (2 - 1) * local * seq * 8 + layers * 2 * (2 - 1) * local * seq * d_ff * 4 // 2
    assert float(result_fields(out)["sharded_over_official_bytes"]) == pytest.approx(sharded / official, abs=5e-4)


@pytest.mark.dist
@pytest.mark.slow
def test_exchange_issues_fewer_collectives_than_before():
    out = run_benchmark(
        "table_comm.py",
        "--exchange",
        "--batch",
        "4",
        "--seq",
        "16",
        "--grad-accum",
        "2",
        "--warmup",
        "1",
        "--reps",
        "1",
    )
    fields = result_fields(out)
    assert set(fields) == {
        "device_after_over_before", "host_after_over_before", "collectives_per_step_before",
        "collectives_per_step_after",
    }  # fmt: skip
    assert int(fields["collectives_per_step_after"]) < int(fields["collectives_per_step_before"])
    assert all(float(fields[f"{t}_after_over_before"]) > 0 for t in ("device", "host"))
