"""benchmarks/table_optim.py in a small mode: every optimizer, the default `rowwise_adagrad` included, is timed
and its two ratios printed."""

from __future__ import annotations

import re

from tests.benchmarks.harness import load_benchmark, result_fields

bench = load_benchmark("table_optim.py")


def test_result_line_times_the_default_optimizer_too(capsys):
    bench.main(["--d-ff", "16", "--batch", "2", "--seq", "8", "--vocabs", "64,256", "--rounds", "1"])
    out = capsys.readouterr().out
    for name in ("adamw", "lazy_adamw", "rowwise_adagrad"):
        assert re.search(rf"\s{name}\s+V=\s+256\s+[\d.]+ ms/step", out)
    fields = result_fields(out)
    assert set(fields) == {"lazy_64k_over_8k", "dense_over_lazy_64k", "adagrad_64k_over_8k", "dense_over_adagrad_64k"}
    assert all(float(v) > 0 for v in fields.values())
