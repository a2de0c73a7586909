"""Training the lookup kinds (`stem_ngram`, `engram`, `memory`): their tables join the table optimizer group and
take row-sparse gradients with the row-sparse optimizers (only the looked-up rows move), the loss goes down,
and a resumed run is bitwise identical.

    OMP_NUM_THREADS=1 python -m pytest tests/train/test_lookup_training.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.train.logging import read_metrics
from stemlm.train.optim import split_parameters
from stemlm.train.trainer import Trainer

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)
KINDS = ["stem_ngram", "engram", "memory"]


def lookup_tables(model):
    return [*model.tables("ngram").values(), *model.tables("memory").values()]


@pytest.mark.parametrize("kind", KINDS)
def test_tables_join_the_table_group_and_move_row_sparsely(tmp_path, make_train_config, make_model_config, kind):
    config = make_model_config(kind, **SMALL)
    trainer = Trainer(
        config, make_train_config(tmp_path, steps=1, eval_every=0, table_optim="lazy_adamw"), progress=False
    )
    tables = lookup_tables(trainer.model)
    assert tables and {id(t.weight) for t in tables} <= {id(p) for p in split_parameters(trainer.model)["tables"]}
    before = [t.weight.detach().clone() for t in tables]
    trainer.fit()
    for table, old in zip(tables, before, strict=True):
        moved = (table.weight.detach() != old).any(dim=1)
        assert table.sparse and 0 < int(moved.sum()) < table.weight.shape[0]  # some rows, not all of them


@pytest.mark.parametrize("kind", KINDS)
def test_loss_goes_down_and_resume_is_exact(tmp_path, make_train_config, make_model_config, kind):
    config = make_model_config(kind, **SMALL)
    kw = dict(steps=8, save_every=4, keep_last=4, eval_every=0, table_optim="lazy_adamw", keep_optimizer_state="all")
    full = Trainer(config, make_train_config(tmp_path / "a", **kw), progress=False)
    result = full.fit()
    assert result["skipped_steps"] == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "a" / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3
    resumed = Trainer.resume(tmp_path / "a" / "run" / "checkpoints" / "step-000004", progress=False)
    resumed.fit()
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
