"""Tests of `stemlm.convert.retrofit`: the "normed" and "calib" table initialisations and the FFN-input alignment.

Independent checks: a "calib" retrofit calibrated on a sequence whose tokens are all distinct reproduces the
dense model's logits on that sequence exactly (each row is then the dense up-projection at that position); a
repeated token gets the mean of its up-projections; with layer 0's attention output zeroed, the layer-0 FFN
input IS the normed embedding (cosine 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.convert.retrofit import calibrated_table, ffn_input_alignment, ffn_inputs, normed_table, retrofit
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from tests.conftest import make_tiny_model


def test_normed_rows_are_up_projection_of_the_normed_embedding():
    dense = make_tiny_model("dense")
    stem = retrofit(dense, "0,2", "normed")
    tokens = torch.arange(dense.config.vocab_size)
    for i in (0, 2):
        block = dense.model.layers[i]
        expected = block.mlp.up_proj(block.post_attention_layernorm(dense.model.embed_tokens(tokens)))
        torch.testing.assert_close(stem.model.layers[i].mlp.stem_embedding.weight, expected)
        torch.testing.assert_close(normed_table(dense, i), expected)


def test_calib_on_distinct_tokens_reproduces_the_dense_logits():
    dense = make_tiny_model("dense")
    ids = torch.randperm(dense.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    stem = retrofit(dense, "all", "calib", ids).eval()
    with torch.no_grad():
        torch.testing.assert_close(stem(ids[None]).logits, dense(ids[None]).logits, atol=1e-5, rtol=1e-5)
        other = torch.tensor([[3, 1, 4, 1, 5]])
        assert not torch.allclose(stem(other).logits, dense(other).logits, atol=1e-3)


def test_calib_averages_repeats_and_falls_back_to_normed():
    dense = make_tiny_model("dense")
    ids = torch.tensor([7, 9, 7, 11, 7])
    inputs = ffn_inputs(dense, ids, [1])[1]
    table, seen = calibrated_table(dense, 1, ids, inputs)
    up = dense.model.layers[1].mlp.up_proj.weight
    assert seen == 3
    torch.testing.assert_close(table[7], (inputs[[0, 2, 4]] @ up.t()).mean(0))
    torch.testing.assert_close(table[9], inputs[1] @ up.t())
    torch.testing.assert_close(table[100], normed_table(dense, 1)[100])


def test_alignment_is_one_where_the_ffn_input_is_the_token():
    dense = make_tiny_model("dense")
    with torch.no_grad():
        dense.model.layers[0].self_attn.o_proj.weight.zero_()
    rows = ffn_input_alignment(dense, torch.tensor([5, 6, 7, 8, 9, 10]))
    assert [r["layer"] for r in rows] == [0, 1, 2]
    assert rows[0]["cos_input"] == pytest.approx(1.0, abs=1e-5) and rows[0]["cos_up"] == pytest.approx(1.0, abs=1e-5)
    assert all(-1 <= r["cos_input"] <= 1 for r in rows) and rows[1]["cos_input"] < 0.999


def test_errors():
    dense = make_tiny_model("dense")
    with pytest.raises(StemlmError, match="unknown retrofit init 'best'"):
        retrofit(dense, "0", "best")
    with pytest.raises(StemlmError, match="needs calibration text"):
        retrofit(dense, "0", "calib", None)


def test_convert_cli_init_calib(tmp_path, capsys):
    tok = default_tokenizer()
    dense = make_tiny_model("dense", vocab_size=tok.get_vocab_size())
    save_pretrained(dense, tmp_path / "dense", tokenizer=tok)
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    args = ["convert", "--from-dense", str(tmp_path / "dense"), "--stem-layers", "0", "--out", str(tmp_path / "s")]
    assert main([*args, "--init", "calib", "--calibration", str(text), "--calibration-tokens", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stem_layers"] == [0]
    ids = torch.tensor(tok.encode(text.read_text()).ids[:64])
    expected = retrofit(dense, "0", "calib", ids)
    got = from_pretrained(tmp_path / "s")
    torch.testing.assert_close(
        got.model.layers[0].mlp.stem_embedding.weight, expected.model.layers[0].mlp.stem_embedding.weight
    )
    assert main([*args[:-1], str(tmp_path / "s2"), "--init", "calib", "--calibration-tokens", "1"]) == 2
    assert "--calibration-tokens must be at least 2" in capsys.readouterr().err


def test_convert_cli_adapter(tmp_path, capsys):
    dense = make_tiny_model("dense")
    save_pretrained(dense, tmp_path / "dense")
    args = ["convert", "--from-dense", str(tmp_path / "dense"), "--stem-layers", "1", "--out", str(tmp_path / "a")]
    assert main([*args, "--retrofit", "adapter", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["ffn"] == "stem_adapter"
    model = from_pretrained(tmp_path / "a")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        model.model.layers[1].mlp.adapter_gate.fill_(-100.0)
        torch.testing.assert_close(model(ids).logits, dense(ids).logits)
