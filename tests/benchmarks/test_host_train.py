"""benchmarks/host_train.py at a toy batch: both trainers step, and the report's figures are in range (the overlap
a share, the host-held bytes positive)."""

from __future__ import annotations

import re

from tests.benchmarks.harness import result_fields, run_benchmark


def test_result_line_and_host_report():
    out = run_benchmark(
        "host_train.py", "--batch", "2", "--seq", "16", "--warmup", "1", "--reps", "2", "--threads", "1"
    )
    fields = {k: float(v) for k, v in result_fields(out).items()}
    assert set(fields) == {"host_over_resident", "overlap"}
    assert fields["host_over_resident"] > 0 and 0 <= fields["overlap"] <= 1
    assert {"resident", "host"} <= {line.split()[0] for line in out.splitlines() if "median" in line}
    assert float(re.search(r"kept off the device: ([\d.]+) MiB", out).group(1)) > 0
