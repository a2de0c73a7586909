"""`--train tables` on 2 gloo ranks: the frozen backbone stays bitwise unchanged on every rank, the row-sharded
tables (and a retrofit adapter's gate logits) learn, and the run is the 1-process run.

The `tables_runs` fixture trains each scenario once on 1 process, then forks 2 ranks that run `Trainer`
on the same configs; each rank compares its own copy of every frozen tensor (the FSDP2 shard gathered with
`full_tensor`) with the freshly built model's and saves the verdicts. A 2-rank checkpoint is then resumed on one
process (the optimizer list without a backbone optimizer must line up). Tolerances: `test_train_dist.TOL`.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_tables_dist.py -q`.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from stemlm.checkpoint.folder import read_state
from stemlm.model import build_model
from stemlm.train.trainer import Trainer

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import TOL, close, losses

# name -> (ffn, overrides). Plain tables: nothing in the backbone learns (no DDP / FSDP2 wrapping at all);
# adapter: the gate logits learn, so DDP / FSDP2 wrap a module whose other parameters are frozen.
SCENARIOS = {
    "tables-ddp": ("stem", dict(parallel="ddp", grad_accum=2, table_optim="adamw")),
    "tables-fsdp": ("stem", dict(parallel="fsdp", table_optim="lazy_adamw")),
    "adapter-ddp": ("stem_adapter", dict(parallel="ddp", table_optim="lazy_adamw")),
    "adapter-fsdp": ("stem_adapter", dict(parallel="fsdp", grad_accum=2, table_optim="adamw")),
}
STEPS = 4


def learns(name: str) -> bool:
    """Whether a parameter name is one `--train tables` trains: a token table or an adapter gate."""
    return name.endswith("stem_embedding.weight") or name.endswith("adapter_gate")


def scenario_config(assets, root, side: str, name: str):
    overrides = dict(SCENARIOS[name][1], trainable="tables", steps=STEPS, eval_every=2, save_every=2)
    return train_config(assets, root / side / name, **overrides)


def _frozen_unchanged(trainer, initial: dict[str, torch.Tensor]) -> dict[str, bool]:
    """{name: bitwise equal to the initial tensor} for every frozen parameter of this rank's model."""
    from torch.distributed.tensor import DTensor

    verdicts = {}
    for name, param in trainer.model.named_parameters():  # the same order on every rank: full_tensor is collective
        if learns(name):
            continue
        value = param.full_tensor() if isinstance(param, DTensor) else param
        verdicts[name] = torch.equal(value.detach(), initial[name])
    return verdicts


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed

    checks = {}
    for name, (ffn, _) in SCENARIOS.items():
        initial = build_model(model_config(ffn), seed=0).state_dict()
        trainer = Trainer(model_config(ffn), scenario_config(assets, root, "two", name), progress=False)
        trainer.fit()
        checks[name] = {
            "frozen": _frozen_unchanged(trainer, initial),
            "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
            "optimizers": len(trainer.optimizers),
        }
    torch.save(checks, root / f"tables_checks{rank}.pt")
    destroy_distributed()


@pytest.fixture(scope="module")
def tables_runs(dist_assets, tmp_path_factory):

    root = tmp_path_factory.mktemp("dist_tables_runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        for name, (ffn, _) in SCENARIOS.items():
            Trainer(model_config(ffn), scenario_config(dist_assets, root, "one", name), progress=False).fit()
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_frozen_backbone_is_bitwise_unchanged_on_every_rank(tables_runs, name):
    ffn = SCENARIOS[name][0]
    for rank in range(2):
        checks = torch.load(tables_runs / f"tables_checks{rank}.pt")[name]
        assert checks["frozen"] and all(checks["frozen"].values()), (rank, checks["frozen"])
        # The only trainable tensors left in the model are the adapter gates (the tables left it for the shards).
        gates = [n for n in checks["trainable"] if n.endswith("adapter_gate")]
        assert checks["trainable"] == gates and bool(gates) == (ffn == "stem_adapter")
        assert checks["optimizers"] == (2 if gates else 1)  # [gates AdamW,] row-shard optimizer
    # And in the saved model: every tensor but tables and gates equals the initial one, bit for bit.
    saved = read_state(tables_runs / "two" / name / "checkpoints" / f"step-{STEPS:06d}")
    initial = build_model(model_config(ffn), seed=0).state_dict()
    assert set(saved) == set(initial)
    assert all(torch.equal(saved[k], v) for k, v in initial.items() if not learns(k))


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tables_learn_as_on_one_process(tables_runs, name):
    one, two = tables_runs / "one" / name, tables_runs / "two" / name
    close(losses(two), losses(one))
    close(losses(two, "heldout_loss", "eval"), losses(one, "heldout_loss", "eval"))
    # Training lowers the loss with the backbone frozen: compared on the same held-out batches (steps 2 and 4),
    # since 4 training losses on 4 different batches differ by more than 4 table-only steps can move them.
    heldout = losses(two, "heldout_loss", "eval")
    assert heldout[-1] < heldout[0]
    got = read_state(two / "checkpoints" / f"step-{STEPS:06d}")
    want = read_state(one / "checkpoints" / f"step-{STEPS:06d}")
    initial = build_model(model_config(SCENARIOS[name][0]), seed=0).state_dict()
    for key in (k for k in initial if learns(k)):
        close(got[key], want[key], msg=key)
        assert (got[key] - initial[key]).abs().max().item() > 100 * TOL, key  # it learned (not vacuous)


@pytest.mark.dist
def test_two_rank_tables_checkpoint_resumes_on_one_process(tables_runs, dist_cache, tmp_path):
    for name in ("tables-ddp", "adapter-fsdp"):
        shutil.copytree(tables_runs / "two" / name, tmp_path / name)
        Trainer.resume(tmp_path / name / "checkpoints" / "step-000002", progress=False).fit()
        close(losses(tmp_path / name), losses(tables_runs / "one" / name))
