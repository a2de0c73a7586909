"""`vllm.LLM` in a Python script, as docs/vllm.md shows it (vLLM's defaults but the KV cache's size: its dtype is the
folder's, float32), on a tiny dense checkpoint as stemlm saved it: greedy tokens equal `stemlm generate --greedy`,
prompt by prompt and as one batch. The STEM checkpoint is served by test_serve.py, the n-gram kinds by
test_ngram_kinds.py.

One engine for the module (a start is tens of seconds on a CPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import PROMPTS, stemlm_greedy, vllm_greedy

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def llm(checkpoints):
    llm = vllm.LLM(
        model=str(checkpoints["dense"]),
        kv_cache_memory_bytes=2**30,  # vLLM's CPU default reserves a share of all the machine's memory
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_the_plugin_built_the_stemlm_architecture_in_the_recorded_dtype(llm):
    config = llm.llm_engine.model_config
    assert config.architecture == "StemlmForCausalLM" and config.hf_config.ffn == "dense"
    assert config.dtype == torch.float32  # no dtype asked: the folder's (stemlm.vllm.auto_dtype)


def test_greedy_tokens_equal_stemlm_prompt_by_prompt(llm, checkpoints):
    assert [vllm_greedy(llm, [p])[0] for p in PROMPTS] == stemlm_greedy(checkpoints["dense"])


def test_greedy_tokens_equal_stemlm_in_one_batch(llm, checkpoints):
    assert vllm_greedy(llm, PROMPTS) == stemlm_greedy(checkpoints["dense"])
