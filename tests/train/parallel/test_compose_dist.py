"""A model composing kinds per layer (STEM on layer 1, value embeddings beside it on both layers) on 2 gloo ranks:
the STEM table and the value tables are all `token` tables, so each is row-sharded over the ranks under its own
key (`ShardedTables`), λ and the backbone go to DDP or FSDP2, and the run trains the 1-process model. Tolerances as in
tests/train/parallel/test_value_embed_dist.py.

    OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_compose_dist.py -q
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
    return model_config("stem").replace(ffn_layers="1", value_embed_layers="all")


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
    root = tmp_path_factory.mktemp("compose_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for name, overrides in FITS.items():
            single = {k: v for k, v in overrides.items() if k != "parallel"}
            Trainer(config(), train_config(dist_assets, root / "one" / name, **single), progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("name", list(FITS))
def test_two_ranks_row_shard_every_token_table_and_train_the_one_process_model(runs, name):
    cfg = config()
    value_width, stem_width = cfg.kv_heads * cfg.head_size, cfg.intermediate_size
    for rank, rows in ((0, 167), (1, 166)):  # 333 rows: rank r holds rows r, r + 2, ...
        shards = json.loads((runs / f"shards-{name}-{rank}.json").read_text())
        # STEM at key 1 (layer 1); value tables past the 2 layers: keys 4 and 5 (value_embed's slot is 2)
        assert shards == {"1": [rows, stem_width], "4": [rows, value_width], "5": [rows, value_width]}
    one, two = losses(runs / "one" / name), losses(runs / "two" / name)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two, one, rtol=0, atol=5e-4)
    assert (one[0] - one[1]).abs() > 1e-2
