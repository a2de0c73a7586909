"""How the benchmark tests reach `benchmarks/`: `load_benchmark("x.py")` imports a script as a module (to call its
`main(argv)` in this process, or its helpers), `run_benchmark("x.py", *args)` runs it as a user would, in a
subprocess from the repository root with this checkout's `src` first on the path and one torch thread (a `.sh`
runs under bash), and `result_fields(out)` reads the `RESULT key=value ...` line it ends with.

Every file of `benchmarks/` is named through one of the first two in some test (tests/benchmarks/
test_every_benchmark.py checks it), so that no benchmark can rot unnoticed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import stemlm

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SRC = Path(stemlm.__file__).resolve().parents[1]  # the stemlm these tests import, not an installed copy
HANG_S = 900  # a hung run fails after this long instead of stalling the suite (not a speed bound)


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>` as a module, registered in sys.modules (a dataclass looks its module up by name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(name).stem}", BENCHMARKS / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run `benchmarks/<name>` with `args`; its stdout. A failed run fails the test with the output's tail."""
    command = ["bash"] if name.endswith(".sh") else [sys.executable]
    extra = os.environ.get("PYTHONPATH")
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), *([extra] if extra else [])]),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    done = subprocess.run(
        [*command, str(BENCHMARKS / name), *map(str, args)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise AssertionError(f"benchmarks/{name} {' '.join(map(str, args))} exited {done.returncode}:\n{tail}")
    return done.stdout


def result_fields(out: str) -> dict[str, str]:
    """The `key=value` fields of the last line, which must be a RESULT line."""
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT "), f"the last line is not a RESULT line: {last!r}"
    return dict(item.split("=", 1) for item in last.removeprefix("RESULT ").split())
