"""vLLM's greedy tokens equal `stemlm generate --greedy` for tiny dense and STEM checkpoints, prompt by prompt and
as one batch. The dense engine loads the folder as stemlm saved it; the STEM engine loads the folder
`stemlm export --remote-code` wrote from it, with its tables selected for vLLM's UVA host offload
(`cpu_offload_params`).

One engine per checkpoint for the whole module (a start is tens of seconds on a CPU). On a CPU the offload is a
no-op (vLLM leaves parameters that are in host memory already where they are), so the STEM engine checks that the
option is accepted and changes nothing; the GPU line of benchmarks/gpu_check.sh runs it where it moves the tables.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import PROMPTS, stemlm_greedy, vllm_greedy

vllm = pytest.importorskip("vllm")

HOST_TABLES = dict(cpu_offload_gb=1, cpu_offload_params={"stem_embedding"})


@pytest.fixture(scope="module", params=["dense", "stem"])
def engine(request, checkpoints):
    kind = request.param
    llm = vllm.LLM(
        model=str(checkpoints["stem-export" if kind == "stem" else kind]),
        dtype="float32",  # stemlm's tokens are fp32's: the comparison is exact only in the same precision
        kv_cache_memory_bytes=2**30,  # vLLM's CPU default reserves a share of all the machine's memory
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        **(HOST_TABLES if kind == "stem" else {}),
    )
    yield kind, llm
    llm.llm_engine.engine_core.shutdown()


def test_greedy_tokens_equal_stemlm_prompt_by_prompt(engine, checkpoints):
    kind, llm = engine
    assert [vllm_greedy(llm, [p])[0] for p in PROMPTS] == stemlm_greedy(checkpoints[kind])


def test_greedy_tokens_equal_stemlm_in_one_batch(engine, checkpoints):
    kind, llm = engine
    assert vllm_greedy(llm, PROMPTS) == stemlm_greedy(checkpoints[kind])


def test_the_plugin_built_the_stemlm_architecture(engine):
    kind, llm = engine
    config = llm.llm_engine.model_config
    assert config.architecture == "StemlmForCausalLM" and config.hf_config.ffn == kind
    assert llm.llm_engine.vllm_config.offload_config.uva.cpu_offload_params == (
        {"stem_embedding"} if kind == "stem" else set()
    )
