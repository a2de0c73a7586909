"""`stemlm tokenizer train` and `encode` through their registered parser."""

import argparse
import json

from stemlm.cli.tokenizer import register


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_train_and_encode(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 20)
    out = tmp_path / "tok"
    assert run(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocab_size"] <= 300 and report["eot_id"] == 0 and (out / "tokenizer.json").is_file()
    assert run(["tokenizer", "encode", "--tokenizer", str(out), "the cat", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] >= 1
    assert run(["tokenizer", "encode", "--tokenizer", "gpt2", "Hello world"]) == 0
    assert capsys.readouterr().out.splitlines() == ["15496 995", "'Hello' 'Ġworld'"]  # ids, then the pieces
