"""benchmarks/matvec_layout.py in a small mode: one row per distinct decode shape, each ratio re-computed from the
printed bandwidths, the rule column being `stored_transposed`'s answer, and `worst_pick` / `rule_holds` following
from the ratios."""

from __future__ import annotations

import re

import pytest
import torch

from stemlm.model.fusion import stored_transposed
from tests.benchmarks.harness import load_benchmark, result_fields

bench = load_benchmark("matvec_layout.py")


def test_rows_ratios_and_the_rule(capsys):
    bench.main(["--mib", "2", "--reps", "1"])
    out = capsys.readouterr().out
    fields = result_fields(out)
    rows = re.findall(r"^(\w+)\s+(\d+)x(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\[\w+, \w+\])$", out, re.M)
    assert {f"{o}x{i}" for _, o, i, *_ in rows} == {k.removeprefix("transposed_over_plain_") for k in fields} - {
        "rule_holds",
        "worst_pick",
    }
    picks = []
    for _, out_f, in_f, plain, transposed, ratio, kept in rows:
        key = f"transposed_over_plain_{out_f}x{in_f}"
        assert float(fields[key]) == pytest.approx(float(transposed) / float(plain), rel=0.1, abs=0.02)
        assert float(ratio) == pytest.approx(float(fields[key]), abs=0.011)  # the table's column is the RESULT's
        rule = stored_transposed(int(out_f), int(in_f), torch.device("cpu"))
        assert kept == ("[in, out]" if rule else "[out, in]")
        picks.append(float(fields[key]) if rule else 1 / float(fields[key]))
    assert float(fields["worst_pick"]) == pytest.approx(min(picks), abs=0.01)
    if abs(float(fields["worst_pick"]) - bench.NOISE) > 0.01:  # two printed decimals cannot settle a near tie
        assert fields["rule_holds"] == str(float(fields["worst_pick"]) >= bench.NOISE)
    assert {"lm_head", "down"} <= {name for name, *_ in rows}
