"""Training `value_embed`: its tables join the table optimizer group and move row-sparsely under the row-sparse
optimizers (only the looked-up rows), λ trains in the backbone's no-decay group, the loss goes down, a resumed
run is bitwise identical, `--train tables` trains the tables and λ only, and `--tables host` trains bitwise like
resident tables.

    OMP_NUM_THREADS=1 python -m pytest tests/train/test_value_embed_training.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.train.logging import read_metrics
from stemlm.train.optim import split_parameters
from stemlm.train.trainer import Trainer
from tests.placement.test_host import same_run

SHARED = dict(num_hidden_layers=3, ffn_layers="all", value_embed_tables=2)  # layer 2 reads layer 0's table


@pytest.mark.parametrize("table_optim", ["lazy_adamw", "rowwise_adagrad"])
def test_tables_move_row_sparsely_and_lambdas_train(tmp_path, make_train_config, make_model_config, table_optim):
    config = make_model_config("value_embed", **SHARED)
    trainer = Trainer(
        config, make_train_config(tmp_path, steps=1, eval_every=0, table_optim=table_optim), progress=False
    )
    tables = list(trainer.model.token_tables().values())
    parts = split_parameters(trainer.model)
    assert len(tables) == 2 and {id(t.weight) for t in tables} == {id(p) for p in parts["tables"]}
    lambdas = [layer.mlp.value_lambda for layer in trainer.model.model.layers]
    assert {id(p) for p in lambdas} <= {id(p) for p in parts["no_decay"]}
    before = [t.weight.detach().clone() for t in tables]
    trainer.fit()
    for table, old in zip(tables, before, strict=True):
        moved = (table.weight.detach() != old).any(dim=1)
        assert table.sparse and 0 < int(moved.sum()) < table.weight.shape[0]  # some rows, not all of them
    assert all(not torch.equal(p.detach(), torch.ones(2)) for p in lambdas)


def test_loss_goes_down_and_resume_is_exact(tmp_path, make_train_config, make_model_config):
    config = make_model_config("value_embed", **SHARED)
    kw = dict(steps=8, save_every=4, keep_last=4, eval_every=0, table_optim="lazy_adamw", keep_optimizer_state="all")
    full = Trainer(config, make_train_config(tmp_path / "a", **kw), progress=False)
    assert full.fit()["skipped_steps"] == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "a" / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3
    resumed = Trainer.resume(tmp_path / "a" / "run" / "checkpoints" / "step-000004", progress=False)
    resumed.fit()
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_train_tables_trains_the_tables_and_lambdas_only(tmp_path, make_train_config, make_model_config):
    config = make_model_config("value_embed", **SHARED)
    trainer = Trainer(config, make_train_config(tmp_path, steps=3, trainable="tables"), progress=False)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.fit()
    changed = {k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])}
    expected = {k for k in before if k.endswith(("value_embedding.weight", "value_lambda"))}
    assert len(expected) == 2 + 3 and changed == expected


@pytest.mark.parametrize("tables", [None, 2])
def test_host_tables_train_bitwise_like_resident(tmp_path, make_train_config, make_model_config, tables):
    config = make_model_config("value_embed", **{**SHARED, "value_embed_tables": tables})
    kw = dict(steps=4, eval_every=2, table_optim="lazy_adamw", grad_accum=2)
    resident = Trainer(config, make_train_config(tmp_path / "a", **kw), progress=False)
    resident.fit()
    host = Trainer(config, make_train_config(tmp_path / "b", tables="host", **kw), progress=False)
    host.fit()
    same_run(resident, host, tmp_path / "a" / "run", tmp_path / "b" / "run")
    for i, table in host.model.token_tables().items():
        assert table.weight is host.tables.params[i]
    assert host.model.model.layers[2].mlp.value_embedding.weight is host.tables.params[0 if tables else 2]
