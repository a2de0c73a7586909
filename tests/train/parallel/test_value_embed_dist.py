"""`value_embed` on 2 gloo ranks: its value tables are `token` tables, so they are row-sharded over the ranks
(`ShardedTables`; a shared table is one shard set, under its owner's index) while λ and the backbone go to DDP
or FSDP2, and the run trains the 1-process model.

Tolerances as in tests/train/parallel/test_lookup_dist.py: the first step's loss agrees to float rounding, later
steps within 5e-4 (Adam normalises each entry's gradient, whose cross-rank sum is rounded in another order).
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_value_embed_dist.py -q`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import losses

FITS = {"ddp": dict(parallel="ddp", table_optim="lazy_adamw"), "fsdp": dict(parallel="fsdp", table_optim="adamw")}


def config():
    return model_config("value_embed").replace(num_hidden_layers=3, ffn_layers="all", value_embed_tables=2)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for name, overrides in FITS.items():
        trainer = Trainer(config(), train_config(assets, root / "two" / name, **overrides), progress=False)
        trainer.fit()
        shards = {i: list(trainer.tables.shard(i).shape) for i in trainer.tables.layers}
        (root / f"shards-{name}-{rank}.json").write_text(json.dumps(shards))
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("value_embed_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for name, overrides in FITS.items():
            single = {k: v for k, v in overrides.items() if k != "parallel"}
            cfg = train_config(dist_assets, root / "one" / name, **single)
            Trainer(config(), cfg, progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("name", list(FITS))
def test_two_ranks_row_shard_the_value_tables_and_train_the_one_process_model(runs, name):
    width = config().kv_heads * config().head_size
    for rank, rows in ((0, 167), (1, 166)):  # 333 rows: rank r holds rows r, r + 2, ...
        shards = json.loads((runs / f"shards-{name}-{rank}.json").read_text())
        assert shards == {"0": [rows, width], "1": [rows, width]}
    one, two = losses(runs / "one" / name), losses(runs / "two" / name)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two, one, rtol=0, atol=5e-4)
    assert (one[0] - one[1]).abs() > 1e-2  # the loss moves far more than the tolerance: the check is not vacuous
