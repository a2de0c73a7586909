"""benchmarks/retrofit_layers.py on a random dense checkpoint: the dense row and one retrofit row, each with a
recall among 0, 1/3, 2/3, 1 (three countries asked) and a perplexity above 1."""

from __future__ import annotations

from tests.benchmarks.harness import result_fields, run_benchmark


def test_dense_and_retrofit_rows(dense_checkpoint):
    out = run_benchmark("retrofit_layers.py", dense_checkpoint, "--sets", "0", "--countries", "3", "--tokens", "64")
    fields = {k: float(v) for k, v in result_fields(out).items()}
    assert set(fields) == {"recall_dense", "ppl_dense", "recall_0", "ppl_0"}
    for key in ("recall_dense", "recall_0"):
        assert round(fields[key] * 3, 2) in (0, 1, 2, 3)
    assert fields["ppl_dense"] > 1 and fields["ppl_0"] > 1
    assert fields["ppl_0"] != fields["ppl_dense"]  # the retrofit replaced layer 0's up-projection
