"""Training a model that composes kinds per layer (STEM on layer 1, value embeddings beside the FFN of both layers):
every token table (STEM's and the value tables) joins the table optimizer group and moves row-sparsely, λ of the
side modules trains, `--train tables` trains the tables and λ only, `--tables host` trains bitwise like resident
tables, and `stemlm train --set model.value_embed_layers=...` runs from the command line.

    OMP_NUM_THREADS=1 python -m pytest tests/train/test_compose_training.py -q
"""

from __future__ import annotations

import json

import torch

from stemlm.model.config import ModelConfig
from stemlm.train.optim import split_parameters
from stemlm.train.trainer import Trainer
from tests.placement.test_host import same_run
from tests.train.test_cli import run_cli, small  # noqa: F401 (small: a fixture)

COMPOSED = dict(ffn_layers="1", value_embed_layers="all", value_embed_tables=1)  # layer 1 reads layer 0's table


def test_every_token_table_moves_row_sparsely_and_lambdas_train(tmp_path, make_train_config, make_model_config):
    config = make_model_config("stem", **COMPOSED)
    trainer = Trainer(
        config, make_train_config(tmp_path, steps=1, eval_every=0, table_optim="lazy_adamw"), progress=False
    )
    tables = trainer.model.token_tables()
    assert list(tables) == [1, 4]  # STEM at layer 1, the one value table past the 2 layers
    assert {id(t.weight) for t in tables.values()} == {id(p) for p in split_parameters(trainer.model)["tables"]}
    lambdas = [layer.beside.value_embed.value_lambda for layer in trainer.model.model.layers]
    before = [t.weight.detach().clone() for t in tables.values()]
    trainer.fit()
    for table, old in zip(tables.values(), before, strict=True):
        moved = (table.weight.detach() != old).any(dim=1)
        assert table.sparse and 0 < int(moved.sum()) < table.weight.shape[0]
    assert all(not torch.equal(p.detach(), torch.ones(2)) for p in lambdas)


def test_train_tables_trains_the_tables_and_side_lambdas_only(tmp_path, make_train_config, make_model_config):
    config = make_model_config("stem", **COMPOSED)
    trainer = Trainer(config, make_train_config(tmp_path, steps=2, trainable="tables"), progress=False)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.fit()
    changed = {k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])}
    expected = {k for k in before if k.endswith(("embedding.weight", "value_lambda")) and "embed_tokens" not in k}
    assert len(expected) == 2 + 2 and changed == expected


def test_host_tables_train_bitwise_like_resident(tmp_path, make_train_config, make_model_config):
    config = make_model_config("stem", **COMPOSED)
    kw = dict(steps=3, eval_every=0, table_optim="lazy_adamw")
    resident = Trainer(config, make_train_config(tmp_path / "a", **kw), progress=False)
    resident.fit()
    host = Trainer(config, make_train_config(tmp_path / "b", tables="host", **kw), progress=False)
    host.fit()
    same_run(resident, host, tmp_path / "a" / "run", tmp_path / "b" / "run")
    assert host.model.model.layers[1].beside.value_embed.value_embedding.weight is host.tables.params[4]


def test_cli_train_sets_side_layers(tmp_path, small, capsys):  # noqa: F811
    args = [*small, "model.value_embed_layers=first:1,last:1", "model.value_embed_tables=1"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0, err
    model = json.loads((tmp_path / "run" / "run_config.json").read_text())["model"]
    assert model["value_embed_layers"] == "first:1,last:1"
    assert ModelConfig.from_dict(model).beside_layers("value_embed") == [0, model["num_hidden_layers"] - 1]
