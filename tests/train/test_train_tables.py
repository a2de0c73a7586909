"""`stemlm train --train tables`: only the token tables learn; the backbone stays bit-identical; a model without
tables is refused. Tiny run (hidden 64, 2 layers, seq 32, batch 4) of a couple of steps."""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.train.trainer import Trainer


def test_only_tables_change_and_resume_keeps_them_frozen(tmp_path, make_train_config, make_model_config):
    trainer = Trainer(
        make_model_config("stem"), make_train_config(tmp_path, steps=3, trainable="tables"), progress=False
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.fit()
    changed = {k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])}
    tables = {k for k in before if k.endswith("stem_embedding.weight")}
    assert tables and changed == tables
    resumed = Trainer.resume(tmp_path / "run", overrides={"steps": 4}, progress=False)
    assert {k for k, p in resumed.model.named_parameters() if p.requires_grad} == tables


def test_dense_model_is_refused(tmp_path, make_train_config, make_model_config):
    with pytest.raises(StemlmError, match="--train tables needs a model with token tables"):
        Trainer(make_model_config("dense"), make_train_config(tmp_path, trainable="tables"), progress=False)
    with pytest.raises(StemlmError, match="trainable must be one of all, tables"):
        make_train_config(tmp_path, trainable="backbone")
