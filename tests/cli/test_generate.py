"""Tests of `stemlm generate`: output against the library call, streamed text against the final decode,
incremental decoding of multi-byte characters, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.generate import generate
from stemlm.inference.requests import IncrementalDecoder
from stemlm.model import build_model
from stemlm.model.config import ModelConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = default_tokenizer()
    config = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        ffn_layers=[1],
        initializer_range=0.1,
    )
    model = build_model(config, seed=0).eval()
    folder = save_pretrained(model, tmp_path_factory.mktemp("gen") / "ckpt", tokenizer=tok)
    return folder, model, tok


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_matches_library(ckpt, capsys):
    folder, model, tok = ckpt
    argv = [
        "generate",
        str(folder),
        "Once upon a time",
        "--max-new-tokens",
        "12",
        "--top-p",
        "0.9",
        "--seed",
        "5",
        "--top-k",
        "50",
        "--temperature",
        "0.7",
        "--ignore-eos",
        "--json",
    ]
    out = _json(capsys, argv)
    prompt_ids = tok.encode("Once upon a time").ids
    expected = generate(model, prompt_ids, 12, top_p=0.9, top_k=50, temperature=0.7, seed=5)
    assert out["prompt_ids"] == prompt_ids and out["token_ids"] == expected
    assert out["completion"] == tok.decode(expected)
    assert out["num_new_tokens"] == 12 and out["tokens_per_s"] > 0
    assert out["prompt"] == "Once upon a time"


def test_streamed_text_equals_json_completion(ckpt, capsys):
    folder, _, _ = ckpt
    common = ["generate", str(folder), "--ids", "72,128,103", "--max-new-tokens", "20", "--seed", "3", "--ignore-eos"]
    out = _json(capsys, common + ["--json"])
    assert main(common) == 0
    captured = capsys.readouterr()
    assert captured.out == out["completion"] + "\n"
    assert "20 tokens" in captured.err
    assert out["prompt"] == "hé"


def test_stops_at_the_tokenizers_eos(ckpt, tmp_path, capsys):
    _, model, tok = ckpt
    # A zero lm_head makes every logit 0, so greedy takes id 0 = <|endoftext|> every time.
    model = build_model(model.config, seed=0)
    model.lm_head.weight.data.zero_()
    folder = save_pretrained(model, tmp_path / "eos", tokenizer=tok)
    assert tok.token_to_id("<|endoftext|>") == 0
    argv = ["generate", str(folder), "--ids", "5,6", "--greedy", "--max-new-tokens", "4", "--json"]
    out = _json(capsys, argv)
    assert out["token_ids"] == [0] and out["completion"] == ""
    assert _json(capsys, argv + ["--ignore-eos"])["token_ids"] == [0, 0, 0, 0]


def test_incremental_decoder_holds_back_partial_characters():
    tok = default_tokenizer()
    text = "héllo 🙂 wörld ñ 日本"
    ids = tok.encode(text).ids
    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3  # the 4-byte emoji and the CJK characters span several tokens


def test_incremental_decoder_flushes_an_unfinished_character():
    tok = default_tokenizer()
    ids = tok.encode("a🙂").ids[:2]  # "a" and the first byte of the emoji only
    decoder = IncrementalDecoder(tok)
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == tok.decode(ids)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ids", "1,2,9000"], "token id 9000 is out of vocabulary"),
        (["--ids", "1,x"], "not a comma-separated list"),
        (["hello", "--ids", "1"], "exactly one of"),
        ([], "exactly one of"),
        (["hi", "--top-p", "0"], "top_p"),
    ],
)
def test_errors_are_one_line_exit_2(ckpt, capsys, extra, message):
    folder, _, _ = ckpt
    assert main(["generate", str(folder), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_checkpoint(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_prompt_too_long(ckpt, capsys):
    folder, _, _ = ckpt
    assert main(["generate", str(folder), "--ids", ",".join(["5"] * 64)]) == 2
    assert "max_position_embeddings=64" in capsys.readouterr().err


def test_default_sampling_is_shown_and_used(ckpt, capsys):
    from stemlm.cli.main import build_parser

    folder, model, tok = ckpt
    args = build_parser().parse_args(["generate", str(folder), "x"])
    assert (args.temperature, args.top_k, args.top_p) == (0.8, 50, 0.95)
    out = _json(
        capsys, ["generate", str(folder), "Once upon a time", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    )
    expected = generate(model, tok.encode("Once upon a time").ids, 8, temperature=0.8, top_k=50, top_p=0.95, seed=0)
    assert out["token_ids"] == expected


def test_prompt_from_stdin_and_echo(ckpt, capsys, monkeypatch):
    import io

    folder, _, _ = ckpt
    common = ["generate", str(folder), "--max-new-tokens", "6", "--greedy", "--ignore-eos"]
    reference = _json(capsys, [*common[:2], "Once upon a time", *common[2:], "--json"])
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time\n"))
    assert main([*common[:2], "-", *common[2:], "--echo"]) == 0
    assert capsys.readouterr().out == "Once upon a time" + reference["completion"] + "\n"


def test_dtype_bf16_runs_the_model_under_autocast(ckpt, capsys):
    import torch

    folder, model, tok = ckpt
    argv = ["generate", str(folder), "Once upon a time", "--max-new-tokens", "6", "--greedy", "--ignore-eos", "--json"]
    out = _json(capsys, [*argv, "--dtype", "bf16"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = generate(model, tok.encode("Once upon a time").ids, 6, greedy=True)
    assert out["token_ids"] == expected and out["autocast_dtype"] == "bfloat16"
    assert _json(capsys, argv)["autocast_dtype"] == "float32"  # auto on a CPU
