"""Bad inputs to `stemlm data prepare`, `stemlm data verify` and `stemlm train --data SHARDS`: each is exit 2, one
stderr line naming the file (and field, line or row), and nothing changed (`tests/bad_input.py`). Manifests are
schema-checked (also through the Python API `open_prepared`), dtype and shard sizes are checked when training
starts, special files are "not a regular file", a file given twice is tokenized once with a warning.

Run: `python -m pytest tests/data/test_bad_inputs_data.py -q`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stemlm.cli.main import main
from stemlm.data import train_bpe
from stemlm.data.prepare import prepare
from stemlm.data.stream import open_prepared, read_manifest
from stemlm.errors import StemlmError
from tests.bad_input import refuse, tree
from tests.train.test_cli import MODEL

TEXTS = [f"document {i}: a few words about tables, stems and the quick brown fox." for i in range(40)]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("prepared")
    (root / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare([root / "in.jsonl"], tok, root / "shards", heldout_fraction=0.2, progress=False)
    return root / "shards"


@pytest.fixture
def shards(tmp_path, prepared):
    """A fresh copy of the prepared folder, to break."""
    return Path(shutil.copytree(prepared, tmp_path / "shards"))


def edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def first_shard(m: dict) -> dict:
    return m["splits"]["train"]["shards"][0]


MANIFEST_CASES = [
    (lambda m: m.pop("splits"), "field splits is missing"),
    (lambda m: m.update(splits=[1, 2]), "splits must be an object"),
    (lambda m: m.update(dtype="float16"), "dtype must be uint16 or uint32"),
    (lambda m: m.update(dtype=["uint16"]), "dtype must be uint16 or uint32"),
    (lambda m: m.pop("dtype"), "field dtype is missing"),
    (lambda m: m["splits"].pop("train"), "field splits.train is missing"),
    (lambda m: m["splits"].update(extra={}), "splits must be an object of train and heldout only"),
    (lambda m: m["splits"]["train"].update(shards={}), "splits.train.shards must be a list"),
    (lambda m: m["splits"]["train"]["shards"].append(7), "splits.train.shards[1] must be an object"),
    (lambda m: first_shard(m).update(tokens=-5), "splits.train.shards[0].tokens must be a whole number >= 1"),
    (lambda m: first_shard(m).update(tokens="12"), "splits.train.shards[0].tokens must be a whole number"),
    (lambda m: first_shard(m).update(tokens=True), "splits.train.shards[0].tokens must be a whole number"),
    (lambda m: first_shard(m).update(file="../../etc/passwd"), "splits.train.shards[0].file must be a string"),
    (lambda m: first_shard(m).update(file="/dev/zero"), "splits.train.shards[0].file must be a string"),
    (lambda m: first_shard(m).pop("sha256"), "field splits.train.shards[0].sha256 is missing"),
    (lambda m: first_shard(m).update(sha256="abc"), "splits.train.shards[0].sha256 must be a string"),
    (lambda m: m["splits"]["train"].update(tokens=1), "splits.train.tokens must be the sum of its shards"),
    (lambda m: m.update(tokenizer="tokenizer.json"), "tokenizer must be an object"),
    (lambda m: m["tokenizer"].update(file="../tokenizer.json"), "tokenizer.file must be a file name"),
    (lambda m: m["tokenizer"].update(vocab_size="300"), "tokenizer.vocab_size must be a whole number"),
    (lambda m: m["tokenizer"].update(vocab_size=70000), "dtype must be uint32 for a vocabulary of 70000"),
    (lambda m: m.pop("separator"), "field separator is missing"),
    (lambda m: m.update(sources={}), "sources must be a list"),
    (lambda m: m.update(format="stemlm-prepared-v0"), "is not a stemlm-prepared-v1 manifest"),
]


@pytest.mark.parametrize("change, message", MANIFEST_CASES)
def test_manifest_schema_python_api(shards, tok, change, message):
    edit_manifest(shards, change)
    with pytest.raises(StemlmError, match="manifest.json") as info:
        open_prepared(shards, tok)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", MANIFEST_CASES[:6])
def test_manifest_schema_data_verify(shards, capsys, change, message):
    edit_manifest(shards, change)
    line = refuse(["data", "verify", shards], message, capsys, shards.parent)
    assert str(shards / "manifest.json") in line


@pytest.mark.parametrize(
    "text, message",
    [
        ("{broken", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (RecursionError)"),
        ('{"format": 1' + "0" * 5000 + "}", "not valid JSON (ValueError)"),
        ("[]", "is not a stemlm-prepared-v1 manifest"),
    ],
)
def test_unreadable_manifest(shards, capsys, text, message):
    (shards / "manifest.json").write_text(text)
    refuse(["data", "verify", shards], message, capsys, shards.parent)


def test_deleted_manifest_is_not_an_empty_text_folder(shards, capsys, tmp_path):
    (shards / "manifest.json").unlink()
    message = "holds token shards but no manifest.json"
    refuse(["data", "verify", shards], message, capsys, tmp_path)
    refuse(train_args(shards, tmp_path), message, capsys, tmp_path)


def test_verify_of_a_folder_without_manifest(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    refuse(["data", "verify", tmp_path / "notes"], "not a folder written by `stemlm data prepare`", capsys, tmp_path)


def test_verify_refuses_a_shard_linked_to_dev_zero(shards, capsys):
    shard = shards / first_shard(read_manifest(shards))["file"]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    refuse(["data", "verify", shards], "is not a regular file", capsys, shards.parent)


def train_args(shards: Path, tmp_path: Path) -> list:
    return ["train", "--data", shards, "--out", tmp_path / "run", "--steps", "1", "--seq-len", "8",
            "--batch-size", "2", "--threads", "1", "--no-progress", "--set", *MODEL]  # fmt: skip


def test_train_refuses_a_reinterpreting_dtype(shards, tmp_path, capsys):
    edit_manifest(shards, lambda m: m.update(dtype="float16"))
    refuse(train_args(shards, tmp_path), "dtype must be uint16 or uint32", capsys, tmp_path)


def test_train_refuses_a_shard_of_the_wrong_size(shards, tmp_path, capsys):
    shard = shards / first_shard(read_manifest(shards))["file"]
    with open(shard, "ab") as f:
        f.write(b"\0\0")  # one token more than the manifest records
    refuse(train_args(shards, tmp_path), "the manifest says", capsys, tmp_path)


def test_train_refuses_a_recorded_count_that_does_not_match(shards, tmp_path, capsys):
    def change(m):
        first_shard(m)["tokens"] += 1
        m["splits"]["train"]["tokens"] += 1

    edit_manifest(shards, change)
    refuse(train_args(shards, tmp_path), "the manifest says", capsys, tmp_path)


def test_open_prepared_refuses_a_missing_shard(shards, tok):
    (shards / first_shard(read_manifest(shards))["file"]).unlink()
    with pytest.raises(StemlmError, match="shard .* does not exist"):
        open_prepared(shards, tok)


# ----- data prepare inputs -----
def prepare_args(paths: list, out: Path) -> list:
    return ["data", "prepare", *paths, "--out", out, "--workers", "1", "--no-progress"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "line 1: JSON nested too deeply"),
        ('{"text": "ok", "n": ' + "7" * 5000 + "}\n", "line 1: JSON holds an integer too long"),
        ('{"text": "ok"}\n{"text": "bad \\ud800 text"}\n', "line 2: the text holds a lone surrogate"),
        ('{"text": "ok"}\n{"text": NaN, "x": 1}\n', "line 2: expected a JSON object with a string 'text'"),
    ],
)
def test_prepare_json_errors_name_file_and_line(tmp_path, capsys, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    line = refuse(prepare_args([tmp_path / "in.jsonl"], tmp_path / "out"), message, capsys, tmp_path)
    assert str(tmp_path / "in.jsonl") in line


def test_train_text_data_json_errors_name_file_and_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n{"text": "a \\udfff b"}\n')
    refuse(
        train_args(tmp_path / "in.jsonl", tmp_path),
        f"{tmp_path / 'in.jsonl'} line 2: the text holds a lone surrogate",
        capsys,
        tmp_path,
    )


def test_prepare_corrupt_parquet_page_names_file_and_row_group(tmp_path, capsys):
    texts = [f"parquet row {i}: the quick brown fox jumps over the lazy dog." for i in range(2000)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=500)
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    data[column.data_page_offset + 40 : column.data_page_offset + 240] = b"\xff" * 200
    path.write_bytes(bytes(data))
    line = refuse(prepare_args([path], tmp_path / "out"), "row group 2 (from row 1000) is unreadable", capsys, tmp_path)
    assert str(path) in line


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-dev-zero"])
def test_prepare_special_files_are_not_regular_files(tmp_path, capsys, kind):
    path = tmp_path / "in.txt"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path = Path("/dev/zero")
    refuse(prepare_args([path], tmp_path / "out"), f"data path {path} is not a regular file", capsys, tmp_path)


def test_prepare_missing_input(tmp_path, capsys):
    refuse(prepare_args([tmp_path / "nope.txt"], tmp_path / "out"), "does not exist", capsys, tmp_path)


def test_prepare_out_errors_do_not_name_the_temporary_folder(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("one document")
    (tmp_path / "file").write_text("a file, not a folder")
    line = refuse(prepare_args([tmp_path / "in.txt"], tmp_path / "file" / "out"), "cannot create", capsys, tmp_path)
    assert ".tmp-" not in line and "Errno" not in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_prepare_out_in_a_read_only_folder(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("one document")
    (tmp_path / "ro").mkdir(mode=0o555)
    line = refuse(prepare_args([tmp_path / "in.txt"], tmp_path / "ro" / "out"), "Permission denied", capsys, tmp_path)
    assert ".tmp-" not in line


def test_same_file_twice_is_tokenized_once_with_a_warning(tmp_path, tok, capsys):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXTS[0])
    (tmp_path / "corpus" / "b.txt").write_text(TEXTS[1])
    (tmp_path / "link.txt").symlink_to(tmp_path / "corpus" / "a.txt")
    tok.save(str(tmp_path / "tok.json"))
    args = prepare_args([tmp_path / "corpus", tmp_path / "corpus" / "a.txt", tmp_path / "link.txt"], tmp_path / "out")
    assert main([str(a) for a in [*args, "--tokenizer", tmp_path / "tok.json"]]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("stemlm data: warning: ") for line in err)
    assert "is the same file as" in err[0] and "tokenized once" in err[0]
    once = prepare([tmp_path / "corpus"], tok, tmp_path / "once", progress=False)
    twice = read_manifest(tmp_path / "out")
    assert twice["splits"] == once["splits"] and len(twice["sources"]) == 2


def test_prepare_of_good_input_is_unchanged_by_the_checks(tmp_path, tok, prepared):
    """The marker of the temporary folder never reaches the output; nothing but the shards, tokenizer and manifest."""
    names = sorted(p.name for p in prepared.iterdir())
    assert names == sorted(["manifest.json", "tokenizer.json", *(n for n in names if n.endswith(".bin"))])
    before = tree(prepared.parent)
    read_manifest(prepared)
    assert tree(prepared.parent) == before


@pytest.mark.parametrize("kind, message", [("fifo", "tokenizer .* is not a regular file"), ("gone", "does not exist")])
def test_train_refuses_a_broken_folder_tokenizer(shards, tmp_path, capsys, kind, message):
    (shards / "tokenizer.json").unlink()
    if kind == "fifo":
        os.mkfifo(shards / "tokenizer.json")
    line = refuse(train_args(shards, tmp_path), "tokenizer", capsys, tmp_path)
    assert re.search(message, line), line
