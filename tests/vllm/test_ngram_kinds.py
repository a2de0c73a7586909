"""vLLM's greedy tokens equal `stemlm generate --greedy` for the n-gram kinds: n-gram STEM (orders 2 and 3),
stemlm's Engram, the demo's (reference) Engram, and Engram's branch beside a STEM model's layers: their hashed ids
and causal convs read earlier positions of each request from the plugin's slot stores (stemlm.vllm.history).

The engine is made to exercise every way an earlier position is found: blocks of 32 slots (a decode crosses a
block), at most 16 tokens a step (a 40-token prompt is prefilled in chunks, each reading the chunk before), four
prompts in one batch (prefills and decodes of several requests in one flattened step), and the same prompts again
(vLLM's prefix cache reuses their blocks, and with them the slots the plugin wrote). The n-gram tables are selected
for vLLM's host offload (a no-op on a CPU, accepted). One engine per kind, run in this process (`in_process_llm`).
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import PROMPTS, in_process_llm, stemlm_greedy, vllm_greedy

pytest.importorskip("vllm")

LONG = [(7 * i + 3) % 500 + 100 for i in range(40)]
NGRAM_PROMPTS = [*PROMPTS, LONG]
NEW_TOKENS = 24  # the 9-token prompt decodes past its first block of 32 (vLLM CPU's smallest)


@pytest.fixture(scope="module", params=["stem_ngram", "engram", "engram-reference", "stem+engram"])
def engine(request, ngram_checkpoints):
    with in_process_llm(
        model=str(ngram_checkpoints[request.param]), dtype="float32", kv_cache_memory_bytes=2**28,
        max_model_len=256, max_num_seqs=8, block_size=32, max_num_batched_tokens=16, enforce_eager=True,
        cpu_offload_gb=1, cpu_offload_params={"ngram_embedding", "engram_embedding"},
    ) as llm:  # fmt: skip
        yield request.param, llm


def test_greedy_tokens_equal_stemlm_prompt_by_prompt_then_in_one_batch(engine, ngram_checkpoints):
    name, llm = engine
    expected = stemlm_greedy(ngram_checkpoints[name], NGRAM_PROMPTS, NEW_TOKENS)
    assert [vllm_greedy(llm, [p], NEW_TOKENS)[0] for p in NGRAM_PROMPTS] == expected
    assert vllm_greedy(llm, NGRAM_PROMPTS, NEW_TOKENS) == expected  # the prefix cache now holds these prompts' blocks
