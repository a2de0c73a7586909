"""`memory_variant="reference"` on 2 gloo ranks: the value table both memory layers share is one parameter,
replicated under DDP and its own unit under FSDP2 (`parallel="fsdp"`), its gradient the sum of both layers', and
the run trains the 1-process model. Tolerances as in test_lookup_dist.py.

    OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_memory_reference_dist.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import losses

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, memory_variant="reference")
# parallel -> table optimizer (FSDP2 shards no row-sparse gradients, so it trains the table with dense AdamW)
FITS = {"ddp": "rowwise_adagrad", "fsdp": "adamw"}


def config():
    return model_config("memory").replace(ffn_layers="all", **SMALL)  # both layers read layer 0's table


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for parallel, table_optim in FITS.items():
        cfg = train_config(assets, root / "two" / parallel, parallel=parallel, table_optim=table_optim)
        Trainer(config(), cfg, progress=False).fit()
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_reference_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for parallel, table_optim in FITS.items():
            cfg = train_config(dist_assets, root / "one" / parallel, table_optim=table_optim)
            Trainer(config(), cfg, progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("parallel", list(FITS))
def test_two_ranks_train_the_one_process_model(runs, parallel):
    one, two = losses(runs / "one" / parallel), losses(runs / "two" / parallel)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two, one, rtol=0, atol=5e-4)
    assert (one[0] - one[1]).abs() > 1e-2  # the loss moves far more than the tolerance: the check is not vacuous
