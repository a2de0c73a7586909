"""A tied official preset on 2 ranks: `paper-1b` shrunk (tied embeddings, STEM in layer 2) trains with its table
row-sharded over the ranks (DDP and FSDP2 backbones) as one process trains it, and its checkpoint exports to a tied
model folder. (`--recipe official` is refused under `--nproc`: tests/cli/test_bad_inputs.py.)

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_tied_dist.py -q` (about 20 s).
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.checkpoint.folder import read_state
from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.model import build_model
from stemlm.model.presets import get_preset
from stemlm.train.trainer import Trainer

from .conftest import VOCAB, fork_ranks, train_config

PARALLEL = ("ddp", "fsdp")


def tied_config():
    # the official 1B config at test size: tied, θ 5e5, STEM in layer 2 of 4 (the odd vocabulary gives unequal shards)
    return get_preset("paper-1b").replace(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        ffn_layers=[2],
    )


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for parallel in PARALLEL:
        cfg = train_config(assets, root / "two" / parallel, parallel=parallel, steps=3, save_every=0, eval_every=3)
        Trainer(tied_config(), cfg, progress=False).fit()
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("tied_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        cfg = train_config(dist_assets, root / "one", steps=3, save_every=0, eval_every=3)
        Trainer(tied_config(), cfg, progress=False).fit()
    return fork_ranks(_worker, root, dist_assets)


@pytest.mark.dist
@pytest.mark.parametrize("parallel", PARALLEL)
def test_two_ranks_train_the_tied_model_and_it_exports_tied(runs, tmp_path, parallel):
    want = read_state(runs / "one" / "checkpoints" / "step-000003")
    assert main(["export", str(runs / "two" / parallel), "--out", str(tmp_path / "out")]) == 0
    got = read_state(tmp_path / "out")
    assert set(got) == set(want) and "lm_head.weight" not in got  # a tied head is not stored twice
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    init = build_model(tied_config(), seed=0).state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in init.items() if k in got) > 1e-3  # it trained
    model = from_pretrained(tmp_path / "out")
    assert model.lm_head.weight is model.model.embed_tokens.weight
