"""A checkpoint records the identity of its training data; resuming on other data is refused (stemlm.train.state).

Raw text is identified by its token shard's content key, a prepared folder by its manifest's digest; resuming with
the same data works, with changed text or another prepared folder fails with one line naming both digests.
"""

from __future__ import annotations

import json
import shutil

import pytest

from stemlm.data import load_tokenizer
from stemlm.data.prepare import prepare
from stemlm.data.stream import manifest_digest
from stemlm.errors import StemlmError
from stemlm.train.trainer import Trainer


def digest_of(run) -> str:
    return json.loads((run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())["data"]["digest"]


def test_resume_on_changed_text_is_refused(tmp_path, make_train_config, make_model_config, train_assets):
    data = tmp_path / "data"
    shutil.copytree(train_assets["data"], data)
    cfg = make_train_config(tmp_path, data=[str(data)], steps=2, eval_every=0)
    Trainer(make_model_config(), cfg, progress=False).fit()
    saved = digest_of(tmp_path / "run")
    assert saved.startswith("text:") and len(saved) == len("text:") + 32
    resumed = Trainer.resume(tmp_path / "run", overrides={"steps": 3}, progress=False)  # same data: fine
    assert resumed.step == 2
    doc = sorted(data.iterdir())[0]
    doc.write_text(doc.read_text() + "\nOne more sentence changes the corpus.\n")
    with pytest.raises(StemlmError, match=f"trained on other data \\(digest {saved}\\) than this run reads now"):
        Trainer.resume(tmp_path / "run", overrides={"steps": 3}, progress=False)


def test_resume_on_another_prepared_folder_is_refused(tmp_path, make_train_config, make_model_config, train_assets):
    tok = load_tokenizer(train_assets["tokenizer"])
    prepare([train_assets["data"]], tok, tmp_path / "a", heldout_fraction=0.3, progress=False)
    prepare([train_assets["data"]], tok, tmp_path / "b", heldout_fraction=0.4, progress=False)
    cfg = make_train_config(tmp_path, data=[str(tmp_path / "a")], tokenizer=None, steps=2, eval_every=0)
    Trainer(make_model_config(), cfg, progress=False).fit()
    assert digest_of(tmp_path / "run") == f"shards:{manifest_digest(tmp_path / 'a')}"
    with pytest.raises(StemlmError, match=f"than this run reads now \\(shards:{manifest_digest(tmp_path / 'b')}\\)"):
        Trainer.resume(tmp_path / "run", overrides={"steps": 3, "data": [str(tmp_path / "b")]}, progress=False)
