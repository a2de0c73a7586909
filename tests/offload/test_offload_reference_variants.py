"""Offloaded generation of the reference variants (`value_embed_variant="reference"`, `ple_variant="reference"`):
their tables are `token` tables, so `--tables host|mmap` serves them through the prefetched token row cache, and
the tokens and logits equal the resident model's.

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_reference_variants.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

PROMPT = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNK, NEW = 8, 8
VARIANTS = {
    "value_embed": dict(
        ffn="value_embed", num_hidden_layers=6, ffn_layers="1,2,-3,-2,-1", value_embed_variant="reference"
    ),
    "ple": dict(ffn="ple", num_hidden_layers=3, ffn_layers="all", ple_dim=16, ple_variant="reference"),
}


def small_model(fields):
    """A small model of `fields`' kind and variant (shared with the Engram reference's offload tests)."""
    config = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        **fields,
    )
    return build_model(config, seed=0)


def checkpoint(folder, fields):
    model = small_model(fields)
    with torch.no_grad():  # large rows and nonzero gates, so the tables matter to the output
        for t in model.token_tables().values():
            t.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        for name, p in model.named_parameters():
            if name.endswith("value_gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return save_pretrained(model.eval(), folder)


def run(folder, tables, **kw):
    with OffloadedLM.load(folder, tables, prefill_chunk=CHUNK, **kw) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        return tokens, forced_decode(lm.model, PROMPT, tokens, rows=lm.rows, prefill_chunk=CHUNK)


@pytest.mark.parametrize("kind", sorted(VARIANTS))
@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_offloaded_equals_resident(tmp_path, kind, tables):
    folder = checkpoint(tmp_path / "ckpt", VARIANTS[kind])
    ref_tokens, ref_forced = run(folder, "resident")
    tokens, forced = run(folder, tables, cache_fraction=0.05)
    assert tokens == ref_tokens
    torch.testing.assert_close(forced, ref_forced, atol=1e-6, rtol=0)
