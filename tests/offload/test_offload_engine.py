"""Offloaded generation: host / mmap tables behind caches of every size give the resident model's tokens and
logits; memory figures; the recorded id stream replays to the same hit / miss counts; prefetch plumbing."""

from __future__ import annotations

import copy

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.generate import generate
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.offload import RowCache, RowPipeline, device_parameter_bytes
from stemlm.offload.providers import HostProvider


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = prompt_ids(50)  # longer than three prefill chunks of 16
CHUNK, NEW = 16, 20


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Last-position logits after each prefix, from one uncached forward over the whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def resident(stem_checkpoint):
    """Tokens and logits of the same checkpoint loaded with its tables resident (the model's own lookups).

    Loaded from disk rather than taken from memory because tensor alignment changes which BLAS kernels
    run: a loaded and a freshly built model differ by ~1e-6 in fp32, tables or no tables."""
    folder, _ = stem_checkpoint
    with OffloadedLM.load(folder, "resident", prefill_chunk=CHUNK) as lm:
        tokens = lm.generate(PROMPT, NEW, greedy=True)
        return tokens, forced_decode(lm.model, PROMPT, tokens[:-1], prefill_chunk=CHUNK)  # what each was sampled from


@pytest.mark.parametrize("tables", ["host", "mmap"])
@pytest.mark.parametrize("capacity", [0, 2, 20, 256])
@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_offloaded_greedy_equals_resident(stem_checkpoint, resident, tables, capacity, policy):
    folder, model = stem_checkpoint
    with OffloadedLM.load(folder, tables, cache_rows=capacity, policy=policy, prefill_chunk=CHUNK) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        stats = copy.copy(lm.stats())  # before the forced decode below adds its own lookups
        logits = forced_decode(lm.model, PROMPT, tokens[:-1], rows=lm.rows, prefill_chunk=CHUNK)
    ref_tokens, ref_logits = resident
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)  # the rows are copies: bit-identical under the same chunking
    # Independent checks: the plain KV-cache generator, and one uncached forward over prompt + output (other
    # matmul shapes and memory alignment, hence a tolerance rather than equality).
    assert tokens == generate(model, PROMPT, NEW, greedy=True)
    full = full_forward_logits(model, PROMPT + tokens)[len(PROMPT) - 1 : -1]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
    assert stats.steps == 4 + NEW - 1 and stats.lookups == len(PROMPT) + NEW - 1
    assert stats.hits + stats.misses == stats.unique_ids
    if capacity == 0:
        assert stats.hits == 0 and stats.bypassed == stats.misses
    if capacity == 2:
        assert stats.bypassed > 0  # smaller than one chunk's distinct ids


def test_sampling_and_other_table_kinds_match(tmp_path, offload_model):
    for ffn in ("stem_gate", "ple"):
        model = offload_model(ffn, seed=1)
        save_pretrained(model, tmp_path / ffn)
        with OffloadedLM.load(tmp_path / ffn, "host", cache_rows=5, prefill_chunk=8) as lm:
            sampled = lm.generate(PROMPT[:20], 15, temperature=0.9, top_p=0.9, seed=5)
        assert sampled == generate(model, PROMPT[:20], 15, temperature=0.9, top_p=0.9, seed=5)


def test_host_tables_are_not_on_the_device(stem_checkpoint):
    folder, model = stem_checkpoint
    cfg = model.config
    table_bytes = len(cfg.special_layers) * cfg.vocab_size * cfg.intermediate_size * 4  # fp32
    with OffloadedLM.load(folder, "host", cache_rows=10) as lm:
        memory = lm.memory()
        assert all(t.weight.is_meta for t in lm.model.token_tables().values())
        assert lm.provider.matrix.numel() * 4 == table_bytes
    assert memory["device_parameter_bytes"] == device_parameter_bytes(model) - table_bytes
    assert memory["device_parameter_bytes"] == sum(p.numel() * 4 for p in model.parameters()) - table_bytes
    assert memory["host_table_bytes"] == table_bytes
    assert memory["cache_device_bytes"] == 10 * len(cfg.special_layers) * cfg.intermediate_size * 4
    with OffloadedLM.load(folder, "resident") as lm:
        assert lm.memory()["device_parameter_bytes"] == device_parameter_bytes(model)
        assert lm.stats() is None


def test_recorded_stream_replays_to_same_counts(stem_checkpoint, reference_sim):
    folder, _ = stem_checkpoint
    for policy in ("lfu", "lru"):
        with OffloadedLM.load(folder, "host", cache_rows=6, policy=policy, prefill_chunk=CHUNK) as lm:
            recorded = []
            plan = lm.cache.policy.plan
            lm.cache.policy.plan = lambda ids, plan=plan, log=recorded: log.append(list(ids)) or plan(ids)
            lm.generate(PROMPT, NEW, greedy=True)
            s = lm.stats()
        counts, _ = reference_sim(recorded, 6, policy)
        assert counts == dict(hits=s.hits, misses=s.misses, evictions=s.evictions, bypassed=s.bypassed)
        assert recorded[0] == PROMPT[:CHUNK] and len(recorded) == 4 + NEW - 1


def test_background_and_synchronous_pipelines_agree(stem_checkpoint):
    folder, _ = stem_checkpoint
    results = []
    for background in (True, False):
        with OffloadedLM.load(folder, "host", cache_rows=9, background=background, prefill_chunk=CHUNK) as lm:
            results.append((lm.generate(PROMPT, NEW, greedy=True), lm.stats().hits, lm.stats().bytes_h2d))
    assert results[0] == results[1]


def test_forced_decode_matches_full_forward(stem_checkpoint):
    folder, model = stem_checkpoint
    continuation = prompt_ids(30, seed=9)
    with OffloadedLM.load(folder, "mmap", cache_rows=12) as lm:
        got = forced_decode(lm.model, PROMPT, continuation, rows=lm.rows, prefill_chunk=CHUNK)
    full = full_forward_logits(model, PROMPT + continuation)[len(PROMPT) - 1 :]
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    with OffloadedLM.load(folder, "resident") as lm:
        assert torch.equal(got, forced_decode(lm.model, PROMPT, continuation, prefill_chunk=CHUNK))


def test_layouts_and_dtypes(stem_checkpoint, tmp_path, offload_model):
    folder, model = stem_checkpoint
    ids = torch.tensor([5, 0, 255, 5, 17])
    rows = {}
    for tables, layout in (("host", "token"), ("host", "layer"), ("mmap", "token")):
        with OffloadedLM.load(folder, tables, layout=layout) as lm:
            rows[tables, layout] = lm.provider.gather(ids)
    expected = torch.cat([model.token_tables()[i].weight[ids] for i in (1, 2)], dim=1)
    assert all(torch.equal(r, expected) for r in rows.values())
    bf16 = offload_model("stem", seed=3).to(torch.bfloat16)
    save_pretrained(bf16, tmp_path / "bf16")
    reference = generate(bf16, PROMPT[:30], 10, greedy=True)
    for tables in ("host", "mmap"):
        with OffloadedLM.load(tmp_path / "bf16", tables, cache_rows=4, prefill_chunk=64) as lm:
            assert lm.provider.dtype == torch.bfloat16
            assert lm.generate(PROMPT[:30], 10, greedy=True) == reference


def test_sharded_checkpoint(tmp_path, offload_model):
    model = offload_model("stem", seed=2)
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    with OffloadedLM.load(tmp_path / "sharded", "mmap", cache_rows=3, prefill_chunk=CHUNK) as lm:
        assert lm.generate(PROMPT, 8, greedy=True) == generate(model, PROMPT, 8, greedy=True)


def test_pipeline_rejects_rows_for_other_ids_and_serves_unrequested(stem_checkpoint):
    _, model = stem_checkpoint
    provider = HostProvider({i: t.weight.detach() for i, t in model.token_tables().items()})
    with RowPipeline(RowCache(provider, 4)) as rows:
        rows.request(torch.tensor([[1, 2, 3]]))
        with pytest.raises(RuntimeError, match="other ids"):
            model(torch.tensor([[4, 5, 6]]), rows={"token": rows})
    with RowPipeline(RowCache(provider, 4)) as rows:  # nothing requested: fetched on first use
        ids = torch.tensor([[7, 8, 7]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids, rows={"token": rows}).logits, model(ids).logits, atol=0, rtol=0)
        assert rows.stats.unique_ids == 2 and rows.stats.lookups == 3


def test_stopping_early_leaves_nothing_pending_and_default_cache_is_a_fifth(stem_checkpoint):
    folder, _ = stem_checkpoint
    with OffloadedLM.load(folder, "host", prefill_chunk=CHUNK) as lm:
        assert lm.cache.capacity == int(0.2 * 256)
        stream = lm.stream(PROMPT, NEW, greedy=True)
        first = [next(stream), next(stream)]
        stream.close()  # the request for the third token's rows was already made
        assert not lm.rows.token.pending
        again = lm.generate(PROMPT, NEW, greedy=True)
    assert again[:2] == first
