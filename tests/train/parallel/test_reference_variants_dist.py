"""The reference variants of Engram, value embeddings and PLE on 2 gloo ranks, under DDP and FSDP2: each trains the
1-process model (memory's reference variant: test_memory_reference_dist.py). Engram's per-layer n-gram tables stay
replicated (the `ngram` family), the value and PLE tables are `token` tables, row-sharded over the ranks.

Tolerances as in test_lookup_dist.py: the first step's loss agrees to float rounding, later steps within 5e-4,
except Engram's under FSDP2 (`LATER`): there steps 1-5 agree to 6.2e-6 and the 6th differs by 7.1e-4 (measured);
the same run over a 12-step schedule stays within 6.3e-5 at every step, so it is rounding of the cross-rank
reduce-scatter amplified at one step (the gate's signed square root, steep near zero), not a wrong gradient, which
would already move the 2nd step's loss by more than 1e-3.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_reference_variants_dist.py -q`.
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import losses

MODELS = {
    # two n-gram layers, each with its own multipliers and prime table sizes
    "engram": lambda: model_config("engram").replace(
        ffn_layers="all", engram_dim=32, engram_heads=2, engram_variant="reference", engram_pad_id=3
    ),
    # modded-nanogpt's five value tables on layers 1,2,-3,-2,-1 of six, with their per-head gates
    "value_embed": lambda: model_config("value_embed").replace(
        num_hidden_layers=6, ffn_layers="1,2,-3,-2,-1", value_embed_variant="reference"
    ),
    # Gemma-3n's per-layer input path on both layers
    "ple": lambda: model_config("ple").replace(ffn_layers="all", ple_dim=16, ple_variant="reference"),
}
# parallel -> table optimizer (FSDP2 shards no row-sparse gradients, so it trains the tables with dense AdamW)
FITS = {"ddp": dict(parallel="ddp", table_optim="lazy_adamw"), "fsdp": dict(parallel="fsdp", table_optim="adamw")}
RUNS = [(model, fit) for model in MODELS for fit in FITS]
LATER = {("engram", "fsdp"): 1e-3}  # the later steps' tolerance where it is not 5e-4 (see above)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    for model, fit in RUNS:
        cfg = train_config(assets, root / "two" / model / fit, **FITS[fit])
        Trainer(MODELS[model](), cfg, progress=False).fit()
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_variants_dist")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for model, fit in RUNS:
            single = {k: v for k, v in FITS[fit].items() if k != "parallel"}
            cfg = train_config(dist_assets, root / "one" / model / fit, **single)
            Trainer(MODELS[model](), cfg, progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("model, fit", RUNS)
def test_two_ranks_train_the_one_process_model(runs, model, fit):
    one, two = losses(runs / "one" / model / fit), losses(runs / "two" / model / fit)
    assert len(one) == len(two) == 6
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(two[:2], one[:2], rtol=0, atol=2e-5)
    torch.testing.assert_close(two, one, rtol=0, atol=LATER.get((model, fit), 5e-4))
    assert (one[0] - one[1]).abs() > 1e-2  # the loss moves far more than the tolerance: the check is not vacuous
