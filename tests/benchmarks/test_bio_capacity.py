"""benchmarks/bio_capacity.py at one size and a toy budget: both kinds train and are scored, the per-parameter
figures divide the knowledge bits by the totals (STEM's active count leaving its tables out), and an existing
--out is refused."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields, run_benchmark


@pytest.mark.slow
def test_small_size_rows_and_result_line(tmp_path):
    out = run_benchmark(
        "bio_capacity.py", "--out", tmp_path / "bio", "--people", "4", "--bios", "1", "--steps", "2", "--sizes", "small"
    )
    assert set(result_fields(out)) == {"dense_small_bits_per_param", "stem_small_bits_per_param"}
    rows = json.loads((tmp_path / "bio" / "results.json").read_text())["rows"]
    assert set(rows) == {"dense_small", "stem_small"}
    for row in rows.values():
        assert row["bits"]["total"] >= 0
        assert row["bits_per_param"] == pytest.approx(row["bits"]["total"] / row["params_total"])
    assert rows["dense_small"]["params_active"] == rows["dense_small"]["params_total"]
    assert rows["stem_small"]["params_active"] < rows["stem_small"]["params_total"]


def test_unknown_size_and_existing_out_are_refused(tmp_path, capsys):
    bench = load_benchmark("bio_capacity.py")
    with pytest.raises(SystemExit) as info:
        bench.main(["--sizes", "huge", "--out", str(tmp_path / "new")])
    assert info.value.code == 2 and "--sizes must name sizes from small, base" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="exists; choose another --out"):
        bench.main(["--out", str(tmp_path)])
