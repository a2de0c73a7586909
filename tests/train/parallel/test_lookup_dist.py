"""The lookup kinds on 2 gloo ranks: n-gram tables and memory values stay replicated under DDP (row-sparse
gradients when a row-sparse table optimizer is asked for), and train the 1-process model.

Tolerances: the first step's loss agrees to float rounding (same initialisation, the batch split over ranks);
later steps drift by up to ~1e-4 because Adam / Adagrad normalise each table entry's gradient, so the
rounding of the cross-rank gradient sum (another summation order than one process) moves entries whose
gradient is tiny by up to the table lr (10x the backbone's). Gross errors (a rank training on other data,
gradients not averaged or averaged twice) change the step-2 loss by >1e-3 at this lr; see the not-vacuous check.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_lookup_dist.py -q`.
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import losses

SMALL = dict(memory_keys=16, memory_topk=4, memory_heads=2, memory_key_dim=16, engram_dim=32, engram_heads=2)
FITS = {
    "stem_ngram": dict(table_optim="lazy_adamw"),
    "engram": dict(table_optim="adamw", grad_accum=2),
    "memory": dict(table_optim="rowwise_adagrad"),
}


def config(kind):
    return model_config(kind).replace(**SMALL)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for kind, overrides in FITS.items():
        cfg = train_config(assets, root / "two" / kind, parallel="ddp", **overrides)
        Trainer(config(kind), cfg, progress=False).fit()
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for kind, overrides in FITS.items():
            Trainer(config(kind), train_config(dist_assets, root / "one" / kind, **overrides), progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("kind", list(FITS))
def test_two_ranks_train_the_one_process_model(runs, kind):
    one, two = losses(runs / "one" / kind), losses(runs / "two" / kind)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two, one, rtol=0, atol=5e-4)
    assert (one[0] - one[1]).abs() > 1e-2  # the loss moves far more than the tolerance: the check is not vacuous
