"""`stemlm export`: a sharded checkpoint (written here in one process, tests.sharded) becomes a plain model folder.

The 2-rank case (a real `--nproc 2` run) is in tests/train/parallel/test_dist_checkpoint.py; bad inputs are in
tests/cli/test_bad_inputs.py.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from stemlm.checkpoint.folder import read_state
from stemlm.checkpoint.runs import from_pretrained
from stemlm.checkpoint.sharded import is_sharded
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from tests.sharded import write_sharded


def tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=8192,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        ffn="stem",
        ffn_layers="1",
    )


@pytest.fixture
def sharded(tmp_path):
    model = build_model(tiny(), seed=3)
    return model, write_sharded(model, tmp_path / "ckpt", default_tokenizer())


def test_export_writes_the_model_folder_without_unpickling(sharded, tmp_path, monkeypatch, capsys):
    model, ckpt = sharded
    assert is_sharded(ckpt)

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "out": str(tmp_path / "out"),
        "source": str(ckpt),
        "sharded": True,
        "parameters": model.num_parameters(),
        "tokenizer": True,
    }
    got = read_state(tmp_path / "out")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not tiny().tie_word_embeddings}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "out" / "tokenizer.json").is_file() and not (tmp_path / "out" / "dcp").exists()


def test_every_reader_opens_a_sharded_checkpoint_directly(sharded):
    model, ckpt = sharded
    loaded = from_pretrained(ckpt)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_export_refuses_an_existing_target_unless_it_is_its_own_output(sharded, tmp_path, capsys):
    _, ckpt = sharded
    out = tmp_path / "out"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert main(["export", str(ckpt), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(ckpt), "--out", str(out), "--force"]) == 0  # its own earlier output
    with pytest.raises(StemlmError, match="was not written by stemlm export"):
        from stemlm.checkpoint.safe_write import check_target

        check_target(ckpt, producer="stemlm export", force=True)


def test_offload_readers_name_export_for_a_sharded_checkpoint(sharded):
    from stemlm.checkpoint.folder import weight_files

    _, ckpt = sharded
    with pytest.raises(StemlmError, match="stemlm export"):
        weight_files(ckpt)
