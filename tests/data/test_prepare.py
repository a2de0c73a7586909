"""`stemlm data prepare`: text, jsonl and parquet inputs into shards + manifest, identical for any worker count,
checked against direct tokenization; bad input is one error naming the file (and line).

Run: `OMP_NUM_THREADS=1 python -m pytest tests/data/test_prepare.py -q`.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stemlm.cli.main import main
from stemlm.data import train_bpe
from stemlm.data.prepare import prepare
from stemlm.data.stream import read_manifest, verify_shards
from stemlm.errors import StemlmError

DOCS = {
    "a/one.txt": ["The first plain text document.\nIt has two lines."],
    "a/two.md": ["# A markdown file\nwith a heading."],
    "b.jsonl": [f"json document number {i}, with some words." for i in range(40)],
    "c.parquet": [f"parquet row {i}: the quick brown fox." for i in range(30)],
}


@pytest.fixture(scope="module")
def tok():
    return train_bpe([t for texts in DOCS.values() for t in texts], vocab_size=300)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, texts in DOCS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
        elif name.endswith(".parquet"):
            pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path, row_group_size=7)
        else:
            path.write_text(texts[0])
    (root / ".hidden.txt").write_text("never read")
    return root


def split_tokens(folder, split):
    manifest = read_manifest(folder)
    parts = [np.fromfile(folder / s["file"], dtype=manifest["dtype"]) for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def test_tokens_equal_direct_tokenization(tmp_path, corpus, tok):
    manifest = prepare([corpus], tok, tmp_path / "out", progress=False)
    # Files in sorted path order (a/one.txt, a/two.md, b.jsonl, c.parquet), each document then <|endoftext|> (0).
    expected = [i for name in sorted(DOCS) for text in DOCS[name] for i in [*tok.encode(text).ids, 0]]
    assert split_tokens(tmp_path / "out", "train").tolist() == expected
    train = manifest["splits"]["train"]
    assert train["tokens"] == len(expected) and train["documents"] == sum(map(len, DOCS.values()))
    assert manifest["dtype"] == "uint16" and manifest["separator"] == {"token": "<|endoftext|>", "id": 0}
    sources = {s["path"]: s for s in manifest["sources"]}
    parquet = corpus / "c.parquet"
    assert sources[str(parquet)]["sha256"] == hashlib.sha256(parquet.read_bytes()).hexdigest()
    assert sources[str(parquet)]["documents"] == 30 and len(sources) == 4  # the hidden file is skipped
    for shard in train["shards"]:
        assert hashlib.sha256((tmp_path / "out" / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]


def test_same_output_for_any_worker_count_and_shard_size(tmp_path, corpus, tok):
    one = prepare([corpus], tok, tmp_path / "one", heldout_fraction=0.3, progress=False)
    two = prepare([corpus], tok, tmp_path / "two", heldout_fraction=0.3, workers=2, progress=False)
    assert one == two
    for name in (s["file"] for split in one["splits"].values() for s in split["shards"]):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    small = prepare([corpus], tok, tmp_path / "small", heldout_fraction=0.3, shard_tokens=50, progress=False)
    assert len(small["splits"]["train"]["shards"]) > len(one["splits"]["train"]["shards"])
    for split in ("train", "heldout"):
        assert np.array_equal(split_tokens(tmp_path / "small", split), split_tokens(tmp_path / "one", split))
    verify_shards(tmp_path / "small")
    held = one["splits"]["heldout"]
    total = sum(map(len, DOCS.values()))
    assert 0 < held["documents"] < total and held["documents"] + one["splits"]["train"]["documents"] == total


def test_verify_detects_a_changed_shard(tmp_path, corpus, tok):
    prepare([corpus], tok, tmp_path / "out", progress=False)
    shard = tmp_path / "out" / "train-00000.uint16.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(StemlmError, match="does not match its sha256"):
        verify_shards(tmp_path / "out")


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("bin.txt", b"abc\x00\x01def", "bin.txt looks binary"),
        ("latin.txt", "café".encode("latin-1"), "latin.txt is not valid UTF-8"),
        ("bad.jsonl", b'{"text": "ok"}\n\n{"text": broken}\n', "bad.jsonl line 3: invalid JSON"),
        ("field.jsonl", b'{"text": "ok"}\n{"body": "no text"}\n', "field.jsonl line 2: expected a JSON object"),
        ("nul.jsonl", b'{"text": "ok"}\n{"text": "a\x00"}\n', "nul.jsonl line 2 looks binary"),
        ("fake.parquet", b"not parquet at all", "fake.parquet is not a readable parquet file"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, tok, name, content, fragment):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(StemlmError, match=fragment.replace(".", r"\.")):
        prepare([tmp_path / name], tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_parquet_column_and_existing_output(tmp_path, corpus, tok):
    with pytest.raises(StemlmError, match="no column 'body' \\(columns: text, n\\)"):
        prepare([corpus / "c.parquet"], tok, tmp_path / "out", text_field="body", progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(StemlmError, match="already exists"):
        prepare([corpus], tok, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(StemlmError, match="no <\\|eot_id\\|> token"):
        prepare([corpus], tok, tmp_path / "other", separator="<|eot_id|>", progress=False)


def test_cli_prepare_and_errors(tmp_path, corpus, tok, capsys):
    tok.save(str(tmp_path / "tok.json"))
    args = ["data", "prepare", str(corpus), "--tokenizer", str(tmp_path / "tok.json"), "--workers", "1"]
    assert main([*args, "--out", str(tmp_path / "out"), "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 4 and report["train"]["documents"] + report["heldout"]["documents"] == 72
    assert main(["data", "verify", str(tmp_path / "out")]) == 0
    assert "shards match the manifest" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    code = main(["data", "prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"stemlm data: error: {tmp_path / 'bad.jsonl'} line 1: expected a JSON object "
                                 "with a string 'text' field"]  # fmt: skip


def test_summary_of_a_prepared_folder(tmp_path, corpus, tok):
    from stemlm.data.prepare import prepare_summary, render_prepare_summary

    manifest = prepare([corpus], tok, tmp_path / "shards", heldout_fraction=0.3, progress=False)
    report = prepare_summary(manifest, "shards", 0.5)
    splits = manifest["splits"]
    assert report["train"] == {k: splits["train"][k] for k in ("documents", "tokens")} and report["seconds"] == 0.5
    tokens = splits["train"]["tokens"] + splits["heldout"]["tokens"]
    assert render_prepare_summary(report, 0.5).endswith(f"{tokens / 0.5:,.0f} tokens/s")
