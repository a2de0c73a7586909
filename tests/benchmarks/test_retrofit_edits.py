"""benchmarks/retrofit_edits.py on a random dense checkpoint: it knows no capital, so `--all-countries` makes every
edit of the fourteen countries; each phrasing prints its row and the RESULT line holds the three means."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.harness import result_fields, run_benchmark


def test_every_edit_runs_and_the_rates_are_shares(dense_checkpoint):
    out = run_benchmark("retrofit_edits.py", dense_checkpoint, "--sets", "0", "--all-countries")
    rows = re.findall(r"^layers 0 .* known +(\d+)/14 .* P\(new\)>P\(true\) ([\d.]+) \(([\d.]+)\)", out, re.M)
    assert len(rows) == 3  # one per phrasing
    fields = {k: float(v) for k, v in result_fields(out).items()}
    assert set(fields) == {"0_greedy", "0_pnew", "0_locality"}
    assert all(0 <= v <= 1 for v in fields.values())
    pnew = [float(edited) for _, edited, _ in rows]
    assert all(abs(p * 14 - round(p * 14)) < 0.1 for p in pnew)  # a share of the fourteen pairs
    assert fields["0_pnew"] == pytest.approx(sum(pnew) / 3, abs=0.005)  # the rows print two decimals
