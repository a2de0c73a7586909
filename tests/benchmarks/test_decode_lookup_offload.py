"""benchmarks/decode_lookup_offload.py at a toy length: every lookup kind decodes with host and resident tables in
lockstep (the script asserts their logits agree) and reports its ratio; only `memory` fetches on demand."""

from __future__ import annotations

import re

from tests.benchmarks.harness import result_fields, run_benchmark


def test_every_kind_reports_its_ratio():
    out = run_benchmark("decode_lookup_offload.py", "--decode", "4", "--prompt", "4", "--reps", "1")
    fields = {k: float(v) for k, v in result_fields(out).items()}
    kinds = ("stem_ngram", "engram", "memory")
    assert set(fields) == {f"{k}_host_over_resident" for k in kinds} | {"memory_wait_share"}
    assert all(v > 0 for k, v in fields.items() if k.endswith("_over_resident"))
    waits = dict(re.findall(r"^(\w+)\s+host/resident .* on-demand wait share ([\d.]+)$", out, re.M))
    assert set(waits) == set(kinds)
    assert float(waits["stem_ngram"]) == 0 and float(waits["engram"]) == 0  # prefetched, never fetched on demand
    assert 0 <= fields["memory_wait_share"] <= 1
