"""The training table placements behind one protocol: `make_placement` picks one by `--tables` and the world,
each gives a micro-batch's forward the rows of the model's own tables (`rows=`), finishes the gradient those
rows get and steps it with the optimizer it adds or wraps, and the trainer names none of them.

Every placement runs here in a world of one (the row-sharded ones own every row), on a tiny STEM model, against
the same model with resident tables. Run: `OMP_NUM_THREADS=1 python -m pytest tests/placement/test_placement.py
-q`.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.placement.base import Placement
from stemlm.placement.host import AsyncTableOptimizer
from stemlm.placement.registry import PLACEMENTS, TRAIN, make_placement
from stemlm.train import trainer as trainer_module
from stemlm.train.batches import MicroBatches
from stemlm.train.config import TrainConfig
from stemlm.train.optim import build_optimizers
from stemlm.train.world import DistributedWorld, LocalWorld

CPU = torch.device("cpu")
TRAINING = [name for name, cls in PLACEMENTS.items() if TRAIN in cls.purposes]


def tiny(ffn: str = "stem") -> ModelConfig:
    return ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        ffn=ffn,
        ffn_layers="odd",
    )


class Windows:
    """A dataset of deterministic random windows: micro-batch `step` depends on (seed, step) only."""

    def sample_batch(self, batch_size: int, seq_len: int, *, seed: int, step: int, rows: slice | None = None):
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        ids = torch.randint(0, 96, (batch_size, seq_len + 1), generator=generator)
        x, y = ids[:, :-1], ids[:, 1:]
        return (x, y) if rows is None else (x[rows], y[rows])


def place(name: str, model) -> Placement:
    return PLACEMENTS[name].for_training(model, CPU)


def test_make_placement_picks_by_tables_and_world():
    one, ranks = LocalWorld(CPU), DistributedWorld(CPU)  # `ranks`: a world of several (size 1 here, no group)
    kinds = {}
    for world in (one, ranks):
        for tables in ("device", "host"):
            placement = make_placement(TrainConfig(tables=tables, table_optim="lazy_adamw"), build_model(tiny()), world)
            kinds[world.distributed, tables] = placement.name
            placement.close()
    assert kinds == {
        (False, "device"): "resident",
        (False, "host"): "host",
        (True, "device"): "row-sharded",
        (True, "host"): "host-sharded",
    }
    # A model without token tables trains resident anywhere; asking one process to keep none on the host fails.
    dense = build_model(tiny("dense"))
    assert make_placement(TrainConfig(tables="host", table_optim="lazy_adamw"), dense, ranks).name == "resident"
    with pytest.raises(StemlmError, match="--tables host needs a model with token tables"):
        make_placement(TrainConfig(tables="host", table_optim="lazy_adamw"), dense, one)


@pytest.mark.parametrize("name", TRAINING)
def test_a_placement_gives_the_forward_the_model_rows_and_steps_their_gradient(name):
    cfg = TrainConfig(batch_size=2, seq_len=16, table_optim="lazy_adamw", device="cpu", prefetch=0)
    reference = build_model(tiny(), seed=0)
    model = build_model(tiny(), seed=0)
    tables = place(name, model)
    world = LocalWorld(CPU)
    batches = MicroBatches(Windows(), cfg, world, cfg.batch_size, every_rank=tables.every_rank_ids)
    tables.bind(batches, cfg, contextlib.nullcontext)
    optimizers = tables.wrap_optimizers(build_optimizers(model, cfg), cfg)
    x, y = batches.get(0)
    want = reference(x, labels=y).loss
    want.backward()
    tables.begin_step(0, final=True)
    got = model(x, labels=y, rows=tables.rows(0, x)).loss
    got.backward()
    tables.finish_grads()
    assert torch.equal(got, want)
    # The table gradient reaches the parameters that the last optimizer steps, equal to the resident one's.
    stepped = [p for g in getattr(optimizers[-1], "inner", optimizers[-1]).param_groups for p in g["params"]]
    for i, table in reference.token_tables().items():
        owned = {
            "resident": lambda i: model.token_tables()[i].weight,
            "host": lambda i: tables.params[i],
            "row-sharded": lambda i: tables.shard(i),
            "host-sharded": lambda i: tables.shard(i),
        }[name](i)
        assert any(owned is p for p in stepped)
        torch.testing.assert_close(owned.grad.to_dense(), table.weight.grad.to_dense(), rtol=0, atol=1e-7)
    assert isinstance(optimizers[-1], AsyncTableOptimizer) == name.startswith("host")
    # A no-grad forward (evaluation) reads the same rows.
    with torch.no_grad():
        assert torch.equal(model(x, labels=y, rows=tables.eval_rows(x, [x])).loss, want.detach())
    tables.close()


def test_the_trainer_reads_the_protocol_and_names_no_placement():
    source = inspect.getsource(trainer_module)
    for name in ("HostTables", "ShardedTables", "HostShardedTables", "host_tables"):
        assert name not in source
