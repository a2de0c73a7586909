"""vLLM's default dtype (`auto`) for a stemlm folder is the dtype it records (float32), through the plugin's wrap of
vLLM's `_resolve_auto_dtype` (stemlm.vllm.auto_dtype); other models and an explicit `--dtype` keep vLLM's rule.

These fail when vLLM renames or reshapes the function the plugin wraps. The served tokens under the default are
checked by test_readme_command.py (the README's command passes no --dtype).
"""

from __future__ import annotations

import inspect

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import ModelConfig  # noqa: E402
from vllm.config import model as vllm_model_config  # noqa: E402

from stemlm.vllm.auto_dtype import EXPECTED, wrap_auto_dtype  # noqa: E402
from stemlm.vllm.plugin import register  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()


def test_vllm_has_the_function_the_plugin_wraps_and_it_is_wrapped():
    assert wrap_auto_dtype() and wrap_auto_dtype()  # once per process, however often the hook runs
    resolve = vllm_model_config._resolve_auto_dtype
    assert hasattr(resolve, "stemlm_wraps") and not hasattr(resolve.stemlm_wraps, "stemlm_wraps")
    assert list(inspect.signature(resolve.stemlm_wraps).parameters) == EXPECTED


def test_auto_keeps_a_stemlm_folders_float32_and_casts_other_models_as_vllm_does():
    resolve = vllm_model_config._resolve_auto_dtype
    assert resolve("stemlm", torch.float32, is_pooling_model=False) == torch.float32
    assert resolve("stemlm", torch.bfloat16, is_pooling_model=False) == torch.bfloat16
    vllms = resolve.stemlm_wraps("llama", torch.float32, is_pooling_model=False)
    assert vllms != torch.float32  # the rule the plugin sidesteps: a float32 config is served in 16 bits
    assert resolve("llama", torch.float32, is_pooling_model=False) == vllms


@pytest.mark.parametrize(("asked", "served"), [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_stemlm_folders_model_config_has_the_recorded_dtype_unless_asked_otherwise(checkpoints, asked, served):
    assert ModelConfig(model=str(checkpoints["dense"]), dtype=asked).dtype == served
