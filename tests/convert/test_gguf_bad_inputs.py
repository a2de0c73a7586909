"""Bad GGUF files given to `stemlm convert --from-gguf`: each exits 2 with one line naming the field or tensor, and
nothing is written (`tests.bad_input.refuse`).

Each file is a tiny valid Llama GGUF (fp32 tensors, the default tokenizer's 8192 tokens and merges) with one thing
broken: a metadata value of the wrong type or range, a malformed tokenizer, a missing or wrongly shaped tensor,
NaN weights. The file is written with the `gguf` package's own writer, as any producer would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stemlm.data.tokenizer import default_tokenizer
from tests.bad_input import refuse

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'stemlm[gguf]')")
T = gguf.GGUFValueType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2


def _vocab() -> tuple[list[str], list[str]]:
    tok = json.loads(default_tokenizer().to_str())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]


TOKENS, MERGES = _vocab()


def base_meta() -> dict:
    """key -> (value, type[, sub-type]) of a valid tiny Llama GGUF."""
    return {
        "llama.block_count": (LAYERS, T.UINT32),
        "llama.context_length": (256, T.UINT32),
        "llama.embedding_length": (HIDDEN, T.UINT32),
        "llama.feed_forward_length": (FFN, T.UINT32),
        "llama.attention.head_count": (HEADS, T.UINT32),
        "llama.attention.head_count_kv": (KV_HEADS, T.UINT32),
        "llama.rope.freq_base": (10000.0, T.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.pre": ("gpt2", T.STRING),
        "tokenizer.ggml.tokens": (TOKENS, T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": ([3 if t == "<|endoftext|>" else 1 for t in TOKENS], T.ARRAY, T.INT32),
        "tokenizer.ggml.merges": (MERGES, T.ARRAY, T.STRING),
        "tokenizer.ggml.eos_token_id": (0, T.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", T.STRING),
    }


def base_tensors() -> dict[str, tuple[int, ...]]:
    """name -> PyTorch shape of a tied tiny Llama."""
    q, kv = HIDDEN, KV_HEADS * (HIDDEN // HEADS)
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (HIDDEN,),
                f"blk.{i}.attn_q.weight": (q, HIDDEN),
                f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                f"blk.{i}.attn_v.weight": (kv, HIDDEN),
                f"blk.{i}.attn_output.weight": (HIDDEN, q),
                f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
            }
        )
    return shapes


def write(path: Path, meta: dict | None = None, tensors: dict | None = None, fill: dict | None = None) -> Path:
    """A GGUF at `path`: `meta` entries replace the base's (None drops a key), so do `tensors` (name -> shape or
    None); `fill` gives one tensor's values (name -> float, e.g. nan)."""
    keys = {**base_meta(), **(meta or {})}
    shapes = {**base_tensors(), **(tensors or {})}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, spec in keys.items():
        if spec is not None:
            writer.add_key_value(key, spec[0], spec[1], spec[2] if len(spec) > 2 else None)
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if shape is not None:
            values = rng.standard_normal(shape).astype(np.float32)
            if name in (fill or {}):
                values.flat[0] = fill[name]
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def convert(path, out) -> list[str]:
    return ["convert", "--from-gguf", str(path), "--out", str(out)]


def main_ok(argv) -> bool:
    from stemlm.cli.main import main

    return main(argv) == 0


q_rows = HIDDEN
META_CASES = [
    ({"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count is 0"),
    ({"llama.attention.head_count": (3, T.UINT32)}, "head_count 3 does not divide llama.embedding_length 64"),
    ({"llama.attention.head_count_kv": (3, T.UINT32)}, "head_count_kv 3 does not divide"),
    ({"llama.attention.head_count_kv": (0, T.UINT32)}, "llama.attention.head_count_kv is 0"),
    ({"llama.embedding_length": ([64, 64], T.ARRAY, T.UINT32)}, "embedding_length must be an integer, got an array"),
    ({"llama.embedding_length": ("64", T.STRING)}, "llama.embedding_length must be an integer, got '64'"),
    ({"llama.embedding_length": (64.0, T.FLOAT32)}, "llama.embedding_length must be an integer, got 64.0"),
    ({"llama.embedding_length": (True, T.BOOL)}, "llama.embedding_length must be an integer, got True"),
    ({"llama.embedding_length": None}, "GGUF metadata lacks llama.embedding_length"),
    ({"llama.feed_forward_length": (-128, T.INT32)}, "llama.feed_forward_length is -128"),
    ({"llama.block_count": (3, T.UINT32)}, "llama.block_count is 3 but the file has no tensors for blk.2"),
    ({"llama.block_count": (10**9, T.UINT32)}, "llama.block_count is 1000000000; it must be between 1 and 1024"),
    ({"llama.context_length": (0, T.UINT32)}, "llama.context_length is 0"),
    ({"llama.context_length": (2**40, T.UINT64)}, "llama.context_length is 1099511627776"),
    ({"llama.attention.key_length": (15, T.UINT32)}, "head dimension 15 (llama.attention.key_length) must be even"),
    ({"llama.attention.key_length": (2**20, T.UINT32)}, "llama.attention.key_length is 1048576"),
    ({"llama.attention.value_length": (8, T.UINT32)}, "value_length differs from key_length"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), T.FLOAT32)}, "layer_norm_rms_epsilon must be a"),
    ({"llama.attention.layer_norm_rms_epsilon": None}, "lacks llama.attention.layer_norm_rms_epsilon"),
    ({"llama.rope.freq_base": (-1.0, T.FLOAT32)}, "llama.rope.freq_base must be a positive finite number"),
    ({"llama.rope.freq_base": (float("inf"), T.FLOAT32)}, "llama.rope.freq_base must be a positive finite number"),
    ({"llama.rope.scaling.type": ([1, 2], T.ARRAY, T.INT32)}, "llama.rope.scaling.type must be a string"),
    ({"tokenizer.ggml.bos_token_id": (9000, T.UINT32)}, "tokenizer.ggml.bos_token_id is 9000; it must be a token id"),
    ({"tokenizer.ggml.eos_token_id": (-1, T.INT32)}, "tokenizer.ggml.eos_token_id is -1"),
    ({"tokenizer.ggml.eos_token_id": (1.5, T.FLOAT32)}, "tokenizer.ggml.eos_token_id is 1.5"),
    ({"tokenizer.ggml.padding_token_id": (8192, T.UINT32)}, "tokenizer.ggml.padding_token_id is 8192"),
    ({"tokenizer.ggml.unknown_token_id": (10**6, T.UINT32)}, "tokenizer.ggml.unknown_token_id is 1000000"),
    ({"tokenizer.ggml.merges": (["Ġt", *MERGES[1:]], T.ARRAY, T.STRING)}, "tokenizer.ggml.merges[0] is 'Ġt'"),
    ({"tokenizer.ggml.merges": (["Ġ qqqz", *MERGES], T.ARRAY, T.STRING)}, "tokenizer.ggml.merges[0]"),
    ({"tokenizer.ggml.merges": (["a  b", *MERGES], T.ARRAY, T.STRING)}, "tokenizer.ggml.merges[0]"),
    ({"tokenizer.ggml.merges": ([1, 2], T.ARRAY, T.INT32)}, "tokenizer.ggml.merges must be an array of strings"),
    ({"tokenizer.ggml.tokens": (list(range(8192)), T.ARRAY, T.INT32)}, "tokenizer.ggml.tokens must be a non-empty"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens must be a non-empty array of strings"),
    ({"tokenizer.ggml.tokens": (["a", *TOKENS[1:-1], "a"], T.ARRAY, T.STRING)}, "lists a token twice"),
    ({"tokenizer.ggml.token_type": ([1] * 10, T.ARRAY, T.INT32)}, "has 8192 tokens but 10 token types"),
    ({"tokenizer.ggml.token_type": (["x"] * 8192, T.ARRAY, T.STRING)}, "token_type must be an array of integers"),
    ({"tokenizer.ggml.pre": (7, T.UINT32)}, "tokenizer.ggml.pre must be a string, got 7"),
    ({"tokenizer.chat_template": ([1], T.ARRAY, T.INT32)}, "tokenizer.chat_template must be a string"),
]
TENSOR_CASES = [
    ({"blk.1.ffn_down.weight": None}, {}, "lacks tensor blk.1.ffn_down.weight"),
    ({"output_norm.weight": None}, {}, "lacks tensor output_norm.weight"),
    ({"blk.0.attn_q.weight": (q_rows - 2, HIDDEN)}, {}, "tensor blk.0.attn_q.weight has shape [62, 64]"),
    ({"blk.1.attn_k.weight": (q_rows, HIDDEN)}, {}, "tensor blk.1.attn_k.weight has shape [64, 64]"),
    ({"blk.0.ffn_gate.weight": (FFN, HIDDEN + 1)}, {}, "tensor blk.0.ffn_gate.weight has shape [128, 65]"),
    ({"blk.0.attn_norm.weight": (HIDDEN, 1)}, {}, "tensor blk.0.attn_norm.weight has shape [64, 1]"),
    ({"token_embd.weight": (100, HIDDEN)}, {}, "token_embd.weight has shape [100, 64], but the metadata"),
    ({"output.weight": (8000, HIDDEN)}, {}, "tensor output.weight has shape [8000, 64]"),
    ({"blk.2.ffn_up.weight": (FFN, HIDDEN)}, {}, "tensor blk.2.ffn_up.weight lies beyond llama.block_count 2"),
    ({"blk.0.ffn_scale.weight": (4,)}, {}, "'blk.0.ffn_scale.weight' has no Llama counterpart"),
    ({"token_embd.weight": None}, {}, "has no token_embd.weight tensor"),
    ({}, {"blk.1.ffn_down.weight": float("nan")}, "blk.1.ffn_down.weight holds NaN or Inf values; --allow-nonfinite"),
    ({}, {"token_embd.weight": float("inf")}, "token_embd.weight holds NaN or Inf values"),
    ({}, {"output_norm.weight": float("-inf")}, "output_norm.weight holds NaN or Inf values"),
]


@pytest.mark.parametrize(("meta", "message"), META_CASES)
def test_bad_metadata_is_refused_before_writing(tmp_path, capsys, meta, message):
    path = write(tmp_path / "m.gguf", meta=meta)
    refuse(convert(path, tmp_path / "out"), message, capsys, tmp_path)


@pytest.mark.parametrize(("tensors", "fill", "message"), TENSOR_CASES)
def test_bad_tensors_are_refused_before_writing(tmp_path, capsys, tensors, fill, message):
    path = write(tmp_path / "m.gguf", tensors=tensors, fill=fill)
    refuse(convert(path, tmp_path / "out"), message, capsys, tmp_path)


def test_nonfinite_weights_import_when_allowed(tmp_path, capsys):
    from safetensors.torch import load_file

    path = write(tmp_path / "m.gguf", fill={"blk.0.ffn_up.weight": float("nan")})
    assert main_ok([*convert(path, tmp_path / "out"), "--allow-nonfinite"])
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert state["model.layers.0.mlp.up_proj.weight"].isnan().sum() == 1


def test_the_base_file_imports(tmp_path):
    # The cases above break one thing each in a file that is otherwise importable.
    path = write(tmp_path / "m.gguf")
    assert main_ok(convert(path, tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == 8192 and config["num_hidden_layers"] == LAYERS and config["eos_token_id"] == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "folder.gguf", "GGUF file {} is a folder, not a file"),
        (lambda root: Path("/dev/zero"), "GGUF file /dev/zero is not a regular file"),
    ],
)
def test_a_folder_or_device_is_not_a_gguf_file(tmp_path, capsys, make, message):
    (tmp_path / "folder.gguf").mkdir()
    path = make(tmp_path)
    refuse(convert(path, tmp_path / "out"), message.format(path), capsys, tmp_path)


def test_a_fifo_is_not_read(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "pipe.gguf")  # opening it to read would block until a writer came
    refuse(convert(tmp_path / "pipe.gguf", tmp_path / "out"), "is not a regular file", capsys, tmp_path)
