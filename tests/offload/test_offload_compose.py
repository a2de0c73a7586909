"""Offloading a model whose layers compose kinds: STEM on the odd layers, value embeddings on the first and last
layers and an Engram branch beside them. The STEM and value tables are one `token` family under distinct keys (a
layer's two tables never collide), the Engram tables the `ngram` family; `stemlm generate --tables host|mmap`
gives the resident model's greedy tokens.

    OMP_NUM_THREADS=1 python -m pytest tests/offload/test_offload_compose.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.offload.families import table_families
from stemlm.placement.load import load_offloaded_model


def composed_config(vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        ffn="stem",
        ffn_layers="odd",
        value_embed_layers="first:1,last:2",
        engram_layers="1",
        engram_dim=32,
        engram_rows=97,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = default_tokenizer()
    model = build_model(composed_config(tok.get_vocab_size()), seed=0)
    with torch.no_grad():  # large rows, so every table matters to the output
        for t in model.token_tables().values():
            t.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return save_pretrained(model.eval(), tmp_path_factory.mktemp("compose") / "ckpt", tokenizer=tok)


def test_families_hold_every_table_under_its_own_key(folder):
    model = build_model(ModelConfig.from_dict(json.loads((folder / "config.json").read_text())), device="meta")
    side = "beside.value_embed.value_embedding.weight"
    assert table_families(model) == {
        "token": {
            1: "model.layers.1.mlp.stem_embedding.weight",
            3: "model.layers.3.mlp.stem_embedding.weight",
            8: f"model.layers.0.{side}",
            10: f"model.layers.2.{side}",
            11: f"model.layers.3.{side}",
        },
        "ngram": {5: "model.layers.1.beside.engram.engram_embedding.weight"},
    }


@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_offloaded_rows_equal_the_model_tables(folder, tables):
    resident, _ = load_offloaded_model(folder, "resident")
    _, providers = load_offloaded_model(folder, tables)
    ids = torch.tensor([3, 17, 3, 250])
    expected = torch.cat([t.weight[ids] for t in resident.token_tables().values()], dim=1)
    torch.testing.assert_close(providers.token.gather(ids), expected, atol=0, rtol=0)
    assert providers.ngram is not None


def test_cli_generate_host_and_mmap_equal_resident(folder, capsys):
    outputs = {}
    for tables in ("resident", "host", "mmap"):
        argv = ["generate", str(folder), "Once upon a time", "--greedy", "--max-new-tokens", "10", "--ignore-eos"]
        extra = [] if tables == "resident" else ["--cache-fraction", "0.1"]
        assert main([*argv, "--tables", tables, *extra, "--json"]) == 0
        outputs[tables] = json.loads(capsys.readouterr().out)
    assert len(outputs["resident"]["token_ids"]) == 10
    assert outputs["host"]["token_ids"] == outputs["mmap"]["token_ids"] == outputs["resident"]["token_ids"]
