"""Tests of `stemlm.convert.driver`: the retrofit table identity U_l[t] = up_proj_l(embed(t)), weight copying, the
checkpoint round trip (dense folder or HF Llama folder -> STEM folder -> from_pretrained + train step) and errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.convert.driver import convert_checkpoint
from stemlm.convert.retrofit import retrofit_from_dense, retrofit_table
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import TokenContext, build_model
from stemlm.model.config import ModelConfig

CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4, ffn="dense"
)


def dense(**kw):
    return build_model(ModelConfig(**{**CONFIG, **kw}), seed=1)


@pytest.mark.parametrize("tied", [False, True])
def test_table_rows_are_up_projection_of_raw_embedding(tied):
    src = dense(tie_word_embeddings=tied)
    stem = retrofit_from_dense(src, "0,2")
    assert stem.config.ffn == "stem" and stem.config.special_layers == [0, 2]
    tokens = torch.arange(src.config.vocab_size)
    for i in (0, 2):
        up = src.model.layers[i].mlp.up_proj
        expected = up(src.model.embed_tokens(tokens))
        table = stem.model.layers[i].mlp.stem_embedding(tokens)
        assert table.shape == (src.config.vocab_size, src.config.intermediate_size)
        assert torch.allclose(table, expected, atol=1e-6, rtol=1e-5)
        # The STEM FFN then computes down(silu(gate(x)) * up(embed(t))) for any hidden state x.
        x = torch.randn(1, 7, src.config.hidden_size)
        ids = torch.randint(0, src.config.vocab_size, (1, 7))
        mlp = src.model.layers[i].mlp
        reference = mlp.down_proj(F.silu(mlp.gate_proj(x)) * up(src.model.embed_tokens(ids)))
        got = stem.model.layers[i].mlp(x, TokenContext(input_ids=ids))
        assert torch.allclose(got, reference, atol=1e-6, rtol=1e-5)


def test_other_weights_copied_and_not_shared():
    src = dense()
    stem = retrofit_from_dense(src, "odd")
    src_state, stem_state = src.state_dict(), stem.state_dict()
    assert "model.layers.1.mlp.up_proj.weight" not in stem_state
    assert "model.layers.0.mlp.up_proj.weight" in stem_state
    dropped = ("model.layers.1.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight")
    expected = {k for k in src_state if k not in dropped}
    expected |= {"model.layers.1.mlp.stem_embedding.weight", "model.layers.3.mlp.stem_embedding.weight"}
    assert set(stem_state) == expected
    for name, tensor in src_state.items():
        if name in stem_state:
            assert torch.equal(stem_state[name], tensor), name
            assert stem_state[name].data_ptr() != tensor.data_ptr(), name


def test_tied_model_stays_tied():
    stem = retrofit_from_dense(dense(tie_word_embeddings=True), "1")
    assert stem.lm_head.weight is stem.model.embed_tokens.weight


def test_retrofit_table_chunking_matches_one_matmul(monkeypatch):
    import stemlm.convert.retrofit as convert

    monkeypatch.setattr(convert, "ROW_CHUNK", 7)
    E, W = torch.randn(50, 12, dtype=torch.float64), torch.randn(20, 12, dtype=torch.float64)
    assert torch.allclose(retrofit_table(E, W), E @ W.T)
    half = retrofit_table(E.to(torch.bfloat16), W.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    # bf16 inputs, fp32 accumulation: the result is the exact product of the rounded inputs, rounded once.
    exact = (E.to(torch.bfloat16).double() @ W.to(torch.bfloat16).double().T).to(torch.bfloat16)
    assert torch.allclose(half.double(), exact.double(), rtol=1e-2, atol=1e-2)


def test_errors():
    with pytest.raises(StemlmError, match="needs a dense model"):
        retrofit_from_dense(build_model(ModelConfig(**{**CONFIG, "ffn": "stem", "ffn_layers": [1]})), "2")
    with pytest.raises(StemlmError, match="bad layer spec"):
        retrofit_from_dense(dense(), "1,x")
    with pytest.raises(StemlmError, match="out of range"):
        retrofit_from_dense(dense(), "7")
    with pytest.raises(StemlmError, match="selects no layer"):
        retrofit_from_dense(dense(), "none")


def test_convert_checkpoint_then_init_from_is_loadable(tmp_path):
    tok = default_tokenizer()
    src = dense(vocab_size=tok.get_vocab_size())
    ckpt = save_pretrained(src, tmp_path / "dense", tokenizer=tok)
    argv = ["convert", "--from-dense", str(ckpt), "--stem-layers", "all-but-first", "--out", str(tmp_path / "stem")]
    assert main(argv) == 0
    model = from_pretrained(tmp_path / "stem")
    assert model.config.special_layers == [1, 2, 3]
    assert (tmp_path / "stem" / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()
    expected = retrofit_from_dense(src, "all-but-first")
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.model.layers[1].mlp.stem_embedding.weight.grad is not None


def test_convert_cli_errors(tmp_path, capsys):
    convert = lambda src, out: main(["convert", "--from-dense", str(src), "--stem-layers", "1", "--out", str(out)])
    stem_ckpt = save_pretrained(
        build_model(ModelConfig(**{**CONFIG, "ffn": "stem", "ffn_layers": [1]})), tmp_path / "s"
    )
    assert convert(stem_ckpt, tmp_path / "o") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a dense model" in err[0]
    dense_ckpt = save_pretrained(dense(), tmp_path / "d")
    assert convert(dense_ckpt, stem_ckpt) == 2
    assert "already exists" in capsys.readouterr().err
    assert convert(tmp_path / "missing", tmp_path / "o") == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_convert_hf_llama_folder(tmp_path):
    # A Llama folder as transformers writes it: HF config fields, the same tensor names, a tokenizer.json.
    tok = default_tokenizer()
    src = dense(vocab_size=tok.get_vocab_size(), num_key_value_heads=2)
    folder = tmp_path / "llama"
    folder.mkdir()
    llama_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "vocab_size": 8192,
        "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": src.config.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(llama_config))
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(folder / "model.safetensors"))
    tok.save(str(folder / "tokenizer.json"))
    out = convert_checkpoint(folder, "1,3", tmp_path / "stem")
    model = from_pretrained(out)
    assert model.config.special_layers == [1, 3] and model.config.kv_heads == 2
    expected = retrofit_from_dense(src, "1,3")
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert (out / "tokenizer.json").is_file()


def test_convert_progress_steps_per_stage_on_a_terminal_unless_no_progress(tmp_path, tty_stderr):
    ckpt = save_pretrained(dense(), tmp_path / "dense")
    argv = ["convert", "--from-dense", str(ckpt), "--stem-layers", "1", "--retrofit", "adapter", "--json"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    assert last.startswith("convert: 100%") and "| 4/4 [" in last and "save" in last, last
    assert main([*argv, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert tty_stderr.readouterr().err == ""
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]
