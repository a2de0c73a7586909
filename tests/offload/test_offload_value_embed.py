"""Offloaded generation of `value_embed`: its value tables are `token` tables, so with `--tables host|mmap` they are
served through the token row cache, every forward's rows prefetched (requested before the forward that reads
them), and the tokens and logits equal the resident model's, also through `stemlm generate --tables mmap`.

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_value_embed.py -q
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
from stemlm.offload.prefetch import RowPipeline

PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNK, NEW = 8, 12


def checkpoint(folder, vocab: int = 256, tokenizer=None):
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        ffn="value_embed",
        ffn_layers="all",
        value_embed_tables=2,
    )
    model = build_model(config, seed=0)
    with torch.no_grad():  # large rows, so the value embeddings matter to the output
        for t in model.token_tables().values():
            t.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return save_pretrained(model.eval(), folder, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("value_embed") / "ckpt")


def run(folder, tables, **kw):
    with OffloadedLM.load(folder, tables, prefill_chunk=CHUNK, **kw) as lm:
        tokens = list(lm.stream(PROMPT, NEW, greedy=True))
        forced = forced_decode(lm.model, PROMPT, tokens, rows=lm.rows, prefill_chunk=CHUNK)
        return tokens, forced[:-1], forced, lm.report()  # forced[:-1]: the logits each token was sampled from


def test_value_tables_are_the_token_family(folder):
    model = build_model(ModelConfig.from_dict(json.loads((folder / "config.json").read_text())), device="meta")
    assert table_families(model) == {
        "token": {0: "model.layers.0.mlp.value_embedding.weight", 1: "model.layers.1.mlp.value_embedding.weight"}
    }


@pytest.mark.parametrize("tables", ["host", "mmap"])
@pytest.mark.parametrize("fraction", [0.0, 0.05, 1.0])
def test_offloaded_equals_resident_with_every_step_prefetched(folder, tables, fraction, monkeypatch):
    ref_tokens, ref_logits, ref_forced, _ = run(folder, "resident")
    ahead = []
    step_for = RowPipeline._step_for

    def recording(self, ids):  # was this forward's fetch requested before the forward asked for its rows?
        ahead.append(bool(self.pending) or (self.current is not None and self.current[0] is ids))
        return step_for(self, ids)

    monkeypatch.setattr(RowPipeline, "_step_for", recording)
    tokens, logits, forced, report = run(folder, tables, cache_fraction=fraction)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(forced, ref_forced, atol=1e-6, rtol=0)
    with torch.no_grad():  # independent: one uncached forward over prompt + output
        full = from_pretrained(folder)(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
    assert ahead and all(ahead)
    cache = report["cache"]  # the token cache: one lookup per position, both tables' rows at once
    assert cache["steps"] == (4 + NEW - 1) + (4 + NEW)
    assert cache["lookups"] == (len(PROMPT) + NEW - 1) + (len(PROMPT) + NEW)
    assert (cache["hits"] > 0) == (fraction > 0)


def test_cli_generate_mmap_equals_resident(tmp_path, capsys):
    tok = default_tokenizer()
    path = checkpoint(tmp_path / "ckpt", vocab=tok.get_vocab_size(), tokenizer=tok)
    outputs = {}
    for tables in ("resident", "mmap"):
        argv = ["generate", str(path), "Once upon a time", "--greedy", "--max-new-tokens", "10", "--ignore-eos"]
        extra = ["--cache-fraction", "0.1"] if tables == "mmap" else []
        assert main([*argv, "--tables", tables, *extra, "--json"]) == 0
        outputs[tables] = json.loads(capsys.readouterr().out)
    assert outputs["mmap"]["token_ids"] == outputs["resident"]["token_ids"] and len(outputs["mmap"]["token_ids"]) == 10
    assert outputs["mmap"]["tables"]["placement"] == "mmap"
