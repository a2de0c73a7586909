"""A model folder is untrusted input too: an index.json naming weights outside the folder, a shard that is a FIFO,
a config.json nested or numbered to break the JSON reader. Each is one line and exit 2 from a loader
(`tests.bad_input.refuse`) and a `StemlmError` from the API; nothing outside the folder is ever opened.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from stemlm.checkpoint.folder import INDEX_NAME, load_config, read_state, save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from tests.bad_input import refuse
from tests.conftest import make_tiny_config


@pytest.fixture
def sharded(tmp_path):
    """A checkpoint saved in several shards (with index.json), and a weights file outside it."""
    folder = tmp_path / "ckpt"
    model = build_model(make_tiny_config("dense", vocab_size=8192))
    save_pretrained(model, folder, tokenizer=default_tokenizer(), max_shard_bytes=600_000)
    assert (folder / INDEX_NAME).is_file()
    first = sorted(folder.glob("model-*.safetensors"))[0]
    (tmp_path / "outside.safetensors").write_bytes(first.read_bytes())
    return folder


def point(folder, target) -> None:
    index = json.loads((folder / INDEX_NAME).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = target
    (folder / INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize(
    "target", ["../outside.safetensors", "{root}/outside.safetensors", "sub/x.safetensors", "..", "", "a\\b"]
)
def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path, capsys, target):
    target = target.format(root=tmp_path)
    point(sharded, target)
    refuse(["generate", sharded, "--ids", "1,2"], "which is not a file of", capsys, tmp_path)
    with pytest.raises(StemlmError, match=re.escape(f"names weights file {target!r}")):
        read_state(sharded)


@pytest.mark.parametrize("target", [5, None, ["x"]])
def test_an_index_naming_a_non_string_file_is_corrupt(sharded, tmp_path, capsys, target):
    point(sharded, target)
    refuse(["generate", sharded, "--ids", "1,2"], f"{INDEX_NAME} is corrupt", capsys, tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is corrupt"),
        ('{"weight_map": ["model-00001-of-00003.safetensors"]}', "is corrupt"),
        ('{"metadata": {}}', "is corrupt"),
        (b"\xff\xfe{}", "is corrupt"),
    ],
)
def test_a_malformed_index_is_corrupt(sharded, tmp_path, capsys, text, message):
    path = sharded / INDEX_NAME
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    refuse(["generate", sharded, "--ids", "1,2"], message, capsys, tmp_path)


def test_a_shard_that_is_a_fifo_is_not_opened(sharded, tmp_path, capsys):
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    os.mkfifo(shard)  # reading it would block until a writer came
    refuse(["generate", sharded, "--ids", "1,2"], "is not a regular file", capsys, tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 100000 + "]" * 100000, "is not valid JSON (nested too deeply)"),
        ('{"num_hidden_layers": ' + "9" * 5000 + "}", "is not valid JSON (Exceeds the limit"),
    ],
)
def test_a_config_json_that_breaks_the_json_reader_is_one_line(sharded, tmp_path, capsys, text, message):
    (sharded / "config.json").write_text(text)
    refuse(["generate", sharded, "--ids", "1,2"], message, capsys, tmp_path)
    with pytest.raises(StemlmError, match="is not valid JSON"):
        load_config(sharded)
