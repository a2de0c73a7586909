"""Offloaded generation of `memory_variant="reference"`: the one value table the memory layers share is offloaded
once (one provider and row cache, under its owner layer's key, which both layers ask) and host / mmap tables give
the resident model's tokens and logits.

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_memory_reference.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.offload.families import table_families

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, memory_variant="reference")
PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNK, NEW = 8, 10


def reference_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=96,
        ffn="memory",
        ffn_layers="1,2",
        **SMALL,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = build_model(reference_config(), seed=0)
    with torch.no_grad():  # large value rows, so the rows each layer reads matter to the output
        model.tables("memory")[1].weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return save_pretrained(model.eval(), tmp_path_factory.mktemp("memory_reference") / "ckpt")


def run(folder, tables, **kw):
    with OffloadedLM.load(folder, tables, prefill_chunk=CHUNK, **kw) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        forced = forced_decode(lm.model, PROMPT, tokens, rows=lm.rows, prefill_chunk=CHUNK)
        return tokens, forced, lm.report()


def test_the_shared_table_is_one_family_entry():
    model = build_model(reference_config(), device="meta")
    assert table_families(model) == {"memory": {1: "model.layers.1.mlp.memory_values.weight"}}


@pytest.mark.parametrize("tables", ["host", "mmap"])
@pytest.mark.parametrize("fraction", [0.0, 0.1])
def test_offloaded_equals_resident(folder, tables, fraction):
    ref_tokens, ref_forced, _ = run(folder, "resident")
    tokens, forced, report = run(folder, tables, cache_fraction=fraction)
    assert tokens == ref_tokens
    torch.testing.assert_close(forced, ref_forced, atol=1e-6, rtol=0)
    assert set(report["family_caches"]) == {"memory.1"}  # one cache, read by layers 1 and 2
    # Both layers fetch through it once per forward: stream (ceil(30 / 8) prefill chunks + NEW - 1 decode steps)
    # and forced decoding (the same prefill + NEW steps).
    assert report["family_caches"]["memory.1"]["steps"] == 2 * ((4 + NEW - 1) + (4 + NEW))
