"""Every file of benchmarks/ is run by some test of tests/benchmarks (named to `load_benchmark` or `run_benchmark`
of tests/benchmarks/harness.py), so that a benchmark cannot rot unnoticed; and every name given there exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmarks.harness import BENCHMARKS

NAMED = re.compile(r"""\b(?:load|run)_benchmark\(\s*["']([\w.]+)["']""")


def named_in_tests() -> set[str]:
    tests = Path(__file__).parent.glob("test_*.py")
    return {name for path in tests for name in NAMED.findall(path.read_text())}


def test_every_benchmark_is_run_by_a_test():
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    missing = sorted(scripts - named_in_tests())
    assert not missing, f"no test in tests/benchmarks runs {missing}: add one that runs it in a small mode"


def test_every_name_in_the_tests_is_a_benchmark():
    assert named_in_tests() <= {p.name for p in BENCHMARKS.iterdir()}
