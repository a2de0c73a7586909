"""benchmarks/decode_offload.py at a toy length (the script itself exits when a configuration's logits differ):
its RESULT line, int8 rows stored in fewer bytes than fp32 ones, and the one-line refusal of --fractions
without the 0.2 its RESULT line reports."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields, run_benchmark

SMALL = ["--decode", "4", "--prompt", "4", "--warmup", "8", "--reps", "1", "--warm-chars", "2000"]


def test_result_line_and_stored_row_bytes():
    out = run_benchmark(
        "decode_offload.py", *SMALL, "--ppl-tokens", "64", "--ppl-window", "32", "--fractions", "0,0.2",
        "--table-dtypes", "fp32,int8",
    )  # fmt: skip
    fields = result_fields(out)
    assert set(fields) == {
        "host_cache20_over_resident", "hit_rate_cache20", "int8_ppl_change", "fp32_bytes_per_token",
        "int8_bytes_per_token",
    }  # fmt: skip
    assert 0 <= float(fields["hit_rate_cache20"]) <= 1
    assert {"resident", "host+cache0", "host+cache0.2"} <= {line.split()[0] for line in out.splitlines() if line}
    rows = dict(re.findall(r"^(fp32|int8)\s+[\d.]+\s+[+-][\d.]+%\s+[\d,]+\s+([\d,]+)", out, re.M))
    assert int(rows["int8"].replace(",", "")) < int(rows["fp32"].replace(",", ""))


def test_fractions_without_the_reported_one_are_refused():
    bench = load_benchmark("decode_offload.py")
    with pytest.raises(SystemExit, match="--fractions must include 0.2"):
        bench.main([*SMALL, "--fractions", "0,0.1"])
