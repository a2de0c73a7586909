"""Offloaded generation for the lookup kinds: host / mmap n-gram tables (prefetched through their own hot-row
cache) and memory values (fetched on demand per layer) give the resident model's tokens and logits, also
through `stemlm generate --tables host`.

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_lookup_kinds.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.offload.families import table_families

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)
PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNK, NEW = 8, 12


def checkpoint(folder, kind: str, vocab: int = 256, tokenizer=None):
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=96,
        ffn=kind,
        ffn_layers="1,2",
        stem_ngram_orders="2,3",
        stem_ngram_rows=64,
        engram_rows=64,
        **SMALL,
    )
    model = build_model(config, seed=0)
    with torch.no_grad():  # random tables, so the n-gram rows matter to the output
        for t in (*model.tables("ngram").values(), *model.tables("memory").values()):
            t.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return save_pretrained(model.eval(), folder, tokenizer=tokenizer)


@pytest.fixture(scope="module", params=["stem_ngram", "engram", "memory"])
def folder(request, tmp_path_factory):
    return request.param, checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)


def run(folder, tables, **kw):
    with OffloadedLM.load(folder, tables, prefill_chunk=CHUNK, **kw) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        forced = forced_decode(lm.model, PROMPT, tokens, rows=lm.rows, prefill_chunk=CHUNK)
        return tokens, forced[:-1], forced, lm.report()  # forced[:-1]: the logits each token was sampled from


@pytest.mark.parametrize("tables", ["host", "mmap"])
@pytest.mark.parametrize("fraction", [0.0, 0.05, 1.0])
def test_offloaded_equals_resident(folder, tables, fraction):
    kind, path = folder
    ref_tokens, ref_logits, ref_forced, _ = run(path, "resident")
    tokens, logits, forced, report = run(path, tables, cache_fraction=fraction)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(forced, ref_forced, atol=1e-6, rtol=0)
    with torch.no_grad():  # independent: one uncached forward over prompt + output
        model = from_pretrained(path)
        full = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
    families = report["family_caches"]
    if kind == "memory":
        assert set(families) == {"memory.1", "memory.2"} and report["memory_on_demand_wait_s"] > 0
        assert report["cache"] is None  # no token tables in a memory model
    else:
        ngram = families["ngram"]
        # Two passes: stream (ceil(30 / 8) prefill chunks + NEW - 1 decode steps) and forced decoding (the
        # same prefill + NEW steps); every position looks up orders x heads = 2 x 2 n-gram ids.
        assert ngram["steps"] == (4 + NEW - 1) + (4 + NEW)
        assert ngram["lookups"] == 4 * ((len(PROMPT) + NEW - 1) + (len(PROMPT) + NEW))
        assert (ngram["hits"] > 0) == (fraction > 0)
    assert model.config.ffn == kind


def test_families_of_each_kind(tmp_path):
    for kind, expected in (("stem_ngram", {"token", "ngram"}), ("engram", {"ngram"}), ("memory", {"memory"})):
        model = build_model(ModelConfig(ffn=kind, num_hidden_layers=2, ffn_layers="1", **SMALL), device="meta")
        assert set(table_families(model)) == expected


@pytest.mark.parametrize("kind", ["stem_ngram", "engram", "memory"])
def test_cli_generate_host_equals_resident(tmp_path, capsys, kind):
    tok = default_tokenizer()
    path = checkpoint(tmp_path / "ckpt", kind, vocab=tok.get_vocab_size(), tokenizer=tok)
    outputs = {}
    for tables in ("resident", "host"):
        argv = ["generate", str(path), "Once upon a time", "--greedy", "--max-new-tokens", "10", "--ignore-eos"]
        extra = ["--cache-fraction", "0.1"] if tables == "host" else []
        assert main([*argv, "--tables", tables, *extra, "--json"]) == 0
        outputs[tables] = json.loads(capsys.readouterr().out)
    assert outputs["host"]["token_ids"] == outputs["resident"]["token_ids"] and len(outputs["host"]["token_ids"]) == 10
    assert outputs["host"]["tables"]["placement"] == "host"


def test_serve_resident_view_reads_every_family(folder):
    from stemlm.serve.views import resident_view

    kind, path = folder
    ids = torch.tensor([PROMPT])
    with OffloadedLM.load(path, "host", cache_fraction=0.1) as lm, torch.no_grad():
        view = resident_view(lm)  # the host tables as the model's own parameters, no copy
        assert not any(p.is_meta for p in view.parameters())
        torch.testing.assert_close(view(ids).logits, from_pretrained(path)(ids).logits, atol=1e-6, rtol=0)
