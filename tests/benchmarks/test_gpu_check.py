"""benchmarks/gpu_check.sh --dry-run: every line of the GPU check runs on the CPU at a tiny size (2 gloo processes
where a line uses --nproc) and reports ok, so that the first GPU run loses no line to a stale script. The lines
expected are read from the script itself, so a line added there is expected here too. The vLLM lines report
"skipped" where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.benchmarks.harness import BENCHMARKS, run_benchmark


@pytest.mark.dist
@pytest.mark.slow
def test_every_line_reports_ok():
    # `run gpu_evidence` belongs to the separate `evidence` mode, not to the checks
    lines = set(re.findall(r"\brun (\w+) \d+ ", (BENCHMARKS / "gpu_check.sh").read_text())) - {"gpu_evidence"}
    out = run_benchmark("gpu_check.sh", "--dry-run")  # its exit status, the failed lines, must be 0
    reported = dict(re.findall(r"^\[(\w+)\] (ok|FAILED|skipped)", out, re.M))
    # the vLLM lines run where this Python imports vllm (the harness passes it as $PYTHON) and are skipped elsewhere
    vllm = "ok" if importlib.util.find_spec("vllm") is not None else "skipped"
    assert reported == {line: vllm if line.startswith("vllm_") else "ok" for line in lines}, out
    assert out.splitlines()[0] == "device: cpu (dry run)" and out.splitlines()[-1] == "gpu_check: 0 failed"
