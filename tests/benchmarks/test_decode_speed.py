"""benchmarks/decode_speed.py in a small mode: its RESULT line carries the shares of the bound (the decode rate
times the bytes a token reads over the bandwidth measured in the same clock) and of the matrix-vector products,
and the share the products alone would reach, each re-computed here from the printed figures, and our greedy
tokens equal transformers'."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields

bench = load_benchmark("decode_speed.py")


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_result_line_and_shares(capsys, clock):
    bench.main(["--prompt", "4", "--new", "3", "--reps", "2", "--stream-mib", "8", "--clock", clock])
    out = capsys.readouterr().out
    fields = result_fields(out)
    assert set(fields) == {
        "ours_over_hf", "fused_over_unfused", "share_of_bound", "share_of_matvec", "matvec_share_of_bound",
        "stem_share_of_bound",
        "hf_share_of_bound", "ours_tok_s", "hf_tok_s", "stem_tok_s", "bound_tok_s",
    }  # fmt: skip
    assert "greedy tokens: ours dense == unfused == transformers: True" in out
    row = re.search(r"ours, tiny-dense\s+(\d+)\s+([\d.]+)\s+(\d+)", out)
    tok_s, bound = float(row.group(1)), float(row.group(3))
    assert float(fields["share_of_bound"]) == pytest.approx(tok_s / bound, rel=0.02, abs=2e-3)
    assert float(fields["bound_tok_s"]) == pytest.approx(bound, abs=1)
    matvec_ms, token_ms = (
        float(x) for x in re.search(r"alone: ([\d.]+) ms .* dense model's ([\d.]+) ms", out).groups()
    )
    assert float(fields["share_of_matvec"]) == pytest.approx(matvec_ms / token_ms, rel=0.05, abs=5e-3)
    # the matrix-vector products alone, as a rate against the same bound: the most a step could reach
    ceiling = float(re.search(r"would reach (\d+)% of the bound", out).group(1)) / 100
    assert float(fields["matvec_share_of_bound"]) == pytest.approx(ceiling, abs=0.006)
    assert float(fields["matvec_share_of_bound"]) == pytest.approx(1e3 / bound / matvec_ms, rel=0.05, abs=5e-3)


@pytest.mark.slow
def test_compiled_steps_report_their_ratios_and_share(capsys):
    bench.main(["--prompt", "4", "--new", "3", "--reps", "1", "--stream-mib", "8", "--compile"])
    out = capsys.readouterr().out
    fields = result_fields(out)
    assert "greedy tokens: ours compiled == ours dense: True" in out
    labels = {"compiled": "ours, compiled steps", "dense": "ours, tiny-dense", "hf": "transformers, tiny-dense"}
    tok_s = {k: float(re.search(rf"{label}\s+(\d+)", out).group(1)) for k, label in labels.items()}
    assert float(fields["compiled_over_fused"]) == pytest.approx(tok_s["compiled"] / tok_s["dense"], rel=0.05, abs=0.01)
    assert float(fields["compiled_over_hf"]) == pytest.approx(tok_s["compiled"] / tok_s["hf"], rel=0.05, abs=0.01)
    assert float(fields["compiled_share_of_bound"]) == pytest.approx(
        float(fields["share_of_bound"]) * float(fields["compiled_over_fused"]), rel=0.01, abs=2e-3
    )
    # serve's default (tiny STEM, compiled steps, the batch engine): its tokens and its share of the STEM bound
    assert "greedy tokens: serve default == ours STEM: True" in out
    serve = re.search(r"serve default \(STEM\)\s+(\d+)\s+([\d.]+)\s+(\d+)", out)
    share = float(serve.group(1)) / float(serve.group(3))
    assert float(fields["serve_share_of_bound"]) == pytest.approx(share, rel=0.02, abs=2e-3)
