"""Training on a prepared shard folder (`stemlm train --data SHARDS`): the folder's tokenizer, a bitwise-exact
resume, per-rank row reads equal to the global batch, and a clear error for a tokenizer that did not make it.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_stream_train.py -q`.
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.data import load_tokenizer
from stemlm.data.prepare import prepare
from stemlm.errors import StemlmError
from stemlm.train.trainer import Trainer
from tests.train.test_cli import MODEL, run_cli
from tests.train.test_trainer import Crash, crash_at, train_records


@pytest.fixture(scope="module")
def shards(train_assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepared") / "shards"
    tok = load_tokenizer(train_assets["tokenizer"])
    manifest = prepare([train_assets["data"]], tok, folder, heldout_fraction=0.3, progress=False)
    assert manifest["splits"]["heldout"]["documents"] >= 1  # the six documents' hashes put some in held-out
    return folder


def test_resume_on_shards_is_bitwise_identical(tmp_path, make_train_config, make_model_config, shards):
    config = make_model_config("stem")
    kw = dict(data=[str(shards)], tokenizer=None, steps=6, save_every=3, keep_last=3, eval_every=3)
    full = Trainer(config, make_train_config(tmp_path / "a", **kw), progress=False)
    assert full.heldout_data is not None and type(full.train_data).__name__ == "StreamDataset"
    full.fit()
    crashed = Trainer(config, make_train_config(tmp_path / "b", **kw), fault_injection=crash_at(5), progress=False)
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer.resume(tmp_path / "b" / "run", progress=False)
    assert resumed.step == 3
    resumed.fit()
    reference, again = train_records(tmp_path / "a" / "run"), train_records(tmp_path / "b" / "run")
    assert [r["loss"] for r in again] == [r["loss"] for r in reference]
    assert all(torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True))


def test_other_tokenizer_is_refused(tmp_path, make_train_config, make_model_config, shards):
    cfg = make_train_config(tmp_path, data=[str(shards)], tokenizer="default")
    with pytest.raises(StemlmError, match="was tokenized with another tokenizer"):
        Trainer(make_model_config("stem", vocab_size=8192), cfg, progress=False)
    with pytest.raises(StemlmError, match="one prepared shard folder alone"):
        Trainer(make_model_config("stem"), make_train_config(tmp_path, data=[str(shards), str(shards)]))


def test_cli_train_on_shards_uses_their_tokenizer(tmp_path, shards, capsys):
    args = ["train", "--data", str(shards), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
            "--eval-batches", "1", "--threads", "1", "--no-progress", "--sample-tokens", "3",
            "--out", str(tmp_path / "run"), "--set", *MODEL]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["model"]["vocab_size"] == 320  # fitted to the folder's 320-token tokenizer, not the default
    assert "held-out loss" in out
