"""benchmarks/serve_throughput.py end to end at a toy size: it prints its RESULT line, with every batched and
host-table output equal to single-stream greedy."""

from __future__ import annotations

from tests.benchmarks.harness import load_benchmark, result_fields

bench = load_benchmark("serve_throughput.py")


def test_result_line(capsys):
    small = ["--set", "hidden_size=32", "--set", "intermediate_size=64", "--set", "num_hidden_layers=2"]
    bench.main([*small, "--prompt", "6", "--new", "3", "--reps", "2", "--concurrency", "1,3"])
    fields = result_fields(capsys.readouterr().out)
    assert fields["outputs_equal"] == "1"
    assert set(fields) == {
        "single_stream_tok_s", "batch1_tok_s", "batch3_tok_s", "batch3_over_single", "host_over_resident",
        "host_over_resident_cpu",
        "batch3_over_hf_generate", "outputs_equal",
    }  # fmt: skip
