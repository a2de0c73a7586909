"""benchmarks/retrofit_alignment.py on a random dense checkpoint: one JSON row per layer, and the RESULT line's
cosines are those rows' (layer 0, layer 1, the largest below layer 0)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.harness import result_fields, run_benchmark


def test_result_line_repeats_the_per_layer_rows(dense_checkpoint):
    out = run_benchmark("retrofit_alignment.py", dense_checkpoint, "--tokens", "64", "--json")
    rows = json.loads(out.splitlines()[0])
    fields = {k: float(v) for k, v in result_fields(out).items()}
    assert rows["tokens"] == 64 and [r["layer"] for r in rows["layers"]] == [0, 1]
    cos = [r["cos_input"] for r in rows["layers"]]
    assert all(-1 <= c <= 1 for c in cos)
    assert fields["cos_input_layer0"] == pytest.approx(cos[0], abs=5e-4)
    assert fields["cos_input_layer1"] == pytest.approx(cos[1], abs=5e-4)
    assert fields["max_cos_input_deeper"] == pytest.approx(max(cos[1:]), abs=5e-4)
