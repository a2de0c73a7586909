"""The batch engine with offloaded tables: one provider and one row cache serve every active request (each
step's rows gathered once, de-duplicated), and each request still gets its resident single-stream output."""

from __future__ import annotations

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.inference.requests import Request, SamplingParams
from tests.conftest import make_tiny_model
from tests.inference.test_batching import JOIN_AT, greedy_cases, run_staggered


@pytest.fixture(scope="module", params=["stem", "stem_ngram", "engram", "memory"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch-offload") / request.param
    model = make_tiny_model(request.param, initializer_range=0.1, max_position_embeddings=40)
    save_pretrained(model, folder)
    return folder


@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_offloaded_batch_equals_resident_single_stream(checkpoint, tables):
    with load_inference(checkpoint) as resident:
        expected, _ = greedy_cases(resident.model)
    with load_inference(checkpoint, InferenceOptions(tables=tables, cache_rows=8)) as lm:
        _, requests = greedy_cases(lm.model)
        engine = BatchEngine(lm.model, slots=4)
        run_staggered(engine, requests, JOIN_AT)
        stats = lm.offloaded.family_caches()
    assert [r.output_ids for r in requests] == expected
    assert all(cache.stats.steps > 0 for cache in stats.values())


def test_one_gather_per_step_for_the_whole_batch(tmp_path):
    save_pretrained(make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=40), tmp_path / "c")
    with load_inference(tmp_path / "c", InferenceOptions(tables="host", cache_rows=16)) as lm:
        engine = BatchEngine(lm.model, slots=4)
        same = [engine.submit(Request([7, 8, 9], SamplingParams(max_tokens=5, temperature=0))) for _ in range(4)]
        engine.run_until_idle()
        stats = lm.offloaded.cache.stats
        # The 4 prompts in one prefill forward, then 4 batched steps of 4 identical requests: the prefill's 12
        # positions are 3 distinct rows, each step's 4 positions 1.
        assert engine.steps == 4 and stats.steps == 1 + 4
        assert stats.lookups == 4 * 3 + 4 * 4 and stats.unique_ids == 3 + 4
        assert all(r.output_ids == generate(lm.model, [7, 8, 9], 5, greedy=True) for r in same)
