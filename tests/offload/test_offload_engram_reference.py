"""Offloaded generation of `engram_variant="reference"`: per-layer hashing gives every n-gram layer its own ids and
table size, so each n-gram table is a provider and row cache of its own (`OffloadProviders.ngram_layers`, one
prefetch pipeline per table); `--tables host|mmap` gives the resident model's greedy tokens and logits, as the FFN
kind and beside STEM (whose table keys are not the layer index).

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_engram_reference.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.model.kinds.registry import table_key
from tests.offload.test_offload_reference_variants import small_model

PROMPT = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNK, NEW = 8, 8
REFERENCE = dict(engram_variant="reference", engram_pad_id=3, engram_dim=32, engram_heads=2, engram_rows=97)
SHAPES = {
    "ffn": dict(ffn="engram", num_hidden_layers=3, ffn_layers="0,2", **REFERENCE),
    "beside": dict(ffn="stem", num_hidden_layers=3, ffn_layers="odd", engram_layers="0,1", **REFERENCE),
}


def checkpoint(folder, fields):
    model = small_model(fields)
    with torch.no_grad():  # large n-gram rows and value projections, so the rows matter to the output
        for t in model.lookup_tables()["ngram"].values():
            t.weight.normal_(0, 2.0, generator=torch.Generator().manual_seed(1))
        for name, p in model.named_parameters():
            if "engram_value_proj" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return save_pretrained(model.eval(), folder), model


def run(folder, tables, **kw):
    with OffloadedLM.load(folder, tables, prefill_chunk=CHUNK, **kw) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        forced = forced_decode(lm.model, PROMPT, tokens, rows=lm.rows, prefill_chunk=CHUNK)
        return tokens, forced, lm.report()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_per_layer_ngram_tables_offloaded_equal_resident(tmp_path, shape, tables):
    folder, model = checkpoint(tmp_path / "ckpt", SHAPES[shape])
    assert not model.ngram_hasher.shared
    ref_tokens, ref_forced, _ = run(folder, "resident")
    tokens, forced, report = run(folder, tables, cache_fraction=0.05)
    assert tokens == ref_tokens
    torch.testing.assert_close(forced, ref_forced, atol=1e-6, rtol=0)
    layers = [0, 2] if shape == "ffn" else [0, 1]
    side = None if shape == "ffn" else "engram"
    keys = [table_key(model.config, layer, side) for layer in layers]
    caches = report["family_caches"]
    assert sorted(caches) == sorted(f"ngram.{k}" for k in keys)  # a cache per table, none shared
    sizes = {k: model.lookup_tables()["ngram"][k].weight.shape[0] for k in keys}
    assert len(set(sizes.values())) == len(keys)  # each layer's own prime sizes: tables of different lengths
    for k in keys:
        assert caches[f"ngram.{k}"]["lookups"] > 0


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_serve_resident_view_reads_the_per_layer_tables(tmp_path, shape):
    from stemlm.serve.views import resident_view

    folder, model = checkpoint(tmp_path / "ckpt", SHAPES[shape])
    ids = torch.tensor([PROMPT])
    with OffloadedLM.load(folder, "host", cache_fraction=0.05) as lm, torch.no_grad():
        view = resident_view(lm)  # each per-layer store mapped onto its own table, no copy
        assert not any(p.is_meta for p in view.parameters())
        torch.testing.assert_close(view(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
