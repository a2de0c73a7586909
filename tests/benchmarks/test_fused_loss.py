"""benchmarks/fused_loss.py at a small shape: one RESULT line with the five ratios per vocabulary, and the
saved-for-backward count it reports (exact, unlike the timings) below the plain loss's."""

from __future__ import annotations

import re

from tests.benchmarks.harness import load_benchmark

bench = load_benchmark("fused_loss.py")


def test_result_line_has_each_ratio_per_vocabulary(capsys):
    bench.main(["--vocabs", "64,256", "--tokens", "96", "--hidden", "16", "--chunk", "40", "--reps", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ratios = dict(re.findall(r"(\w+)=([\d.]+|nan)", last))
    kinds = ("plain_time", "plain_peak_bytes", "plain_saved_bytes", "chunked_time", "chunked_peak_bytes")
    assert last.startswith("RESULT ") and set(ratios) == {f"fused_over_{k}_v{v}" for k in kinds for v in (64, 256)}
    # d(hidden) + d(weight), (96 + 256) x 16 fp32, against the head inputs, [96, 256] log-probs and labels kept
    assert 0 < float(ratios["fused_over_plain_saved_bytes_v256"]) < 0.2
