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


def test_the_shipped_tokenizer_is_what_tokenizer_train_writes_and_facts_make_names_whole(tmp_path, capsys):
    from stemlm.data.tokenizer import default_tokenizer, load_tokenizer
    from stemlm.data.worlds.facts import country
    from stemlm.train.config import FACT_COUNTRIES

    assert run(["tokenizer", "train", "--out", str(tmp_path / "corpus"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fact_documents"] == 0
    shipped = default_tokenizer()
    assert (tmp_path / "corpus" / "tokenizer.json").read_text() == shipped.to_str(pretty=True)  # the asset's rebuild
    assert run(["tokenizer", "train", "--out", str(tmp_path / "facts"), "--fact-fraction", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 43 and report["fact_documents"] > 0
    names = [" " + n for c in FACT_COUNTRIES for n in (c, country(c).capital)]
    whole = load_tokenizer(tmp_path / "facts")
    assert all(len(whole.encode(name).ids) == 1 for name in names)  # an edit then swaps one row for one
    assert sum(len(shipped.encode(name).ids) for name in names) > 2 * len(names)


def test_fact_fraction_is_for_the_embedded_corpus_and_a_share(tmp_path, capsys):
    import pytest

    from stemlm.errors import StemlmError

    data = tmp_path / "data.txt"
    data.write_text("the cat sat on the mat\n" * 20)
    for argv, message in (
        (["--data", str(data), "--fact-fraction", "0.5"], "embedded corpus only"),
        (["--fact-fraction", "1"], r"\[0, 1\), got 1"),
        (["--fact-fraction", "nan"], r"\[0, 1\), got nan"),
    ):
        with pytest.raises(StemlmError, match=message):
            run(["tokenizer", "train", "--out", str(tmp_path / "tok"), *argv])
    assert not (tmp_path / "tok").exists()
