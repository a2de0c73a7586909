"""`--recipe official` on 2 ranks trains the model 1 process trains: the official init drawn over each rank's part
(DDP: whole tensors; FSDP2: its rows), the backbone and the row-sharded table clipped apart, lingua's schedule.

Three steps with warm-up 1 (the first update at lr 0) and a clip of 0.01 that clips both the backbone and the
table, against the same run on one process; STEM on DDP and FSDP2, STEM-gate (the other kind the official rules
cover, its token table in the gate's place) on FSDP2. Run: `OMP_NUM_THREADS=1 python -m pytest
tests/train/parallel/test_recipe_dist.py -q` (about 20 s).
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.checkpoint.folder import read_state
from stemlm.model import build_model
from stemlm.train.logging import read_metrics
from stemlm.train.recipes import get_recipe
from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config

CASES = (("stem", "ddp"), ("stem", "fsdp"), ("stem_gate", "fsdp"))  # (kind, backbone parallelism)
OFFICIAL = dict(recipe="official", table_optim="adamw", table_lr_scale=1.0, table_wd=0.1)  # recipes.train_config's
RUN = dict(steps=3, warmup=1, grad_clip=0.01, save_every=0, eval_every=3, **OFFICIAL)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for ffn, parallel in CASES:
        cfg = train_config(assets, root / "two" / f"{ffn}-{parallel}", parallel=parallel, **RUN)
        Trainer(model_config(ffn), cfg, progress=False).fit()
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for ffn in sorted({ffn for ffn, _ in CASES}):
            Trainer(model_config(ffn), train_config(dist_assets, root / "one" / ffn, **RUN), progress=False).fit()
    return fork_ranks(_worker, root, dist_assets)


@pytest.mark.dist
@pytest.mark.parametrize(("ffn", "parallel"), CASES)
def test_two_ranks_train_the_official_one_process_model(runs, ffn, parallel):
    one, two = runs / "one" / ffn, runs / "two" / f"{ffn}-{parallel}"
    train = [[r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] for run in (one, two)]
    assert [r["lr"] for r in train[1]] == [r["lr"] for r in train[0]] and train[0][0]["lr"] == 0.0
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in train[1]]),
        torch.tensor([r["grad_norm"] for r in train[0]]),
        rtol=1e-5,
        atol=0,
    )
    assert min(r["grad_norm"] for r in train[0]) > 10 * RUN["grad_clip"]  # the clips were active
    want = read_state(one / "checkpoints" / "step-000003")
    got = read_state(two / "checkpoints" / "step-000003")
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    # the official init, not the default one, is where both started
    default = build_model(model_config(ffn), seed=0)
    official = build_model(model_config(ffn), seed=0)
    get_recipe("official").init_weights(official, seed=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((got[q] - official.state_dict()[q]).abs().max()) < float(
        (got[q] - default.state_dict()[q]).abs().max()
    )
