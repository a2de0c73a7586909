"""Value embeddings on 2 gloo ranks, as the `value_embed` kind and beside STEM (kinds composed per layer): the value
tables (and STEM's) are `token` tables, so each is row-sharded over the ranks under its own key (`ShardedTables`; a
shared table is one shard set, under its owner's key) while λ and the backbone go to DDP or FSDP2, and the run
trains the 1-process model.

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
MODELS = {
    # the kind: 3 layers sharing 2 value tables (held by layers 0 and 1)
    "value_embed": lambda: model_config("value_embed").replace(
        num_hidden_layers=3, ffn_layers="all", value_embed_tables=2
    ),
    # beside STEM: STEM on layer 1, value embeddings on both layers
    "beside_stem": lambda: model_config("stem").replace(ffn_layers="1", value_embed_layers="all"),
}
RUNS = [(model, fit) for model in MODELS for fit in FITS]


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for model, fit in RUNS:
        trainer = Trainer(
            MODELS[model](), train_config(assets, root / "two" / model / fit, **FITS[fit]), progress=False
        )
        trainer.fit()
        shards = {i: list(trainer.tables.shard(i).shape) for i in trainer.tables.layers}
        (root / f"shards-{model}-{fit}-{rank}.json").write_text(json.dumps(shards))
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("value_embed_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for model, fit in RUNS:
            single = {k: v for k, v in FITS[fit].items() if k != "parallel"}
            Trainer(
                MODELS[model](), train_config(dist_assets, root / "one" / model / fit, **single), progress=False
            ).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


def expected_shards(model: str, rows: int) -> dict[str, list[int]]:
    cfg = MODELS[model]()
    value, stem = cfg.kv_heads * cfg.head_size, cfg.intermediate_size
    if model == "value_embed":
        return {"0": [rows, value], "1": [rows, value]}
    # STEM at key 1 (layer 1); the value tables past the 2 layers: keys 4 and 5 (value_embed's slot is 2)
    return {"1": [rows, stem], "4": [rows, value], "5": [rows, value]}


@pytest.mark.dist
@pytest.mark.parametrize("model, fit", RUNS)
def test_two_ranks_row_shard_the_token_tables_and_train_the_one_process_model(runs, model, fit):
    for rank, rows in ((0, 167), (1, 166)):  # 333 rows: rank r holds rows r, r + 2, ...
        shards = json.loads((runs / f"shards-{model}-{fit}-{rank}.json").read_text())
        assert shards == expected_shards(model, rows)
    one, two = losses(runs / "one" / model / fit), losses(runs / "two" / model / fit)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two, one, rtol=0, atol=5e-4)
    assert (one[0] - one[1]).abs() > 1e-2  # the loss moves far more than the tolerance: the check is not vacuous
