"""The vLLM plugin stays optional: nothing else in stemlm imports `stemlm.vllm` or vLLM, and pyproject.toml declares
the `vllm` extra and the `vllm.general_plugins` entry point vLLM finds the plugin by."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import stemlm

SRC = Path(stemlm.__file__).parent
ROOT = SRC.parents[1]
IMPORTS_VLLM = re.compile(r"^\s*(from|import)\s+(vllm|stemlm\.vllm)\b", re.M)


def test_no_module_outside_stemlm_vllm_imports_vllm():
    outside = [p for p in SRC.rglob("*.py") if "vllm" not in p.relative_to(SRC).parts]
    assert outside and not [str(p) for p in outside if IMPORTS_VLLM.search(p.read_text())]


def test_importing_stemlm_and_its_cli_loads_no_vllm():
    code = (
        "import sys, stemlm, stemlm.cli.main, stemlm.hf, stemlm.serve.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('stemlm.vllm')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_pyproject_declares_the_extra_and_the_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"stemlm": "stemlm.vllm.plugin:register"}
    assert any(r.startswith("vllm") for r in project["optional-dependencies"]["vllm"])


def test_register_adds_the_architecture_to_vllm():
    vllm = pytest.importorskip("vllm")
    from stemlm.vllm.plugin import ARCHITECTURES, register

    register()
    register()  # vLLM calls it once per process it starts; twice is harmless
    assert set(ARCHITECTURES) <= set(vllm.ModelRegistry.get_supported_archs())
