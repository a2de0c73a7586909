"""Sharded checkpoints and meta-device initialisation on 2 gloo processes (stemlm.train.parallel.checkpoint, dist_init).

One fork of 2 ranks runs every scenario: the initial weights each rank materialises (DDP, FSDP2, host tables)
against the 1-process `build_model`, or against the model folder it starts from (`--init-from`); fits with a
sharded checkpoint at step 3 resumed on 2 ranks (DDP, host tables, FSDP2 with row-wise Adagrad); and a run
whose last save fails while being written.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_dist_checkpoint.py -q`.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from stemlm.checkpoint.folder import read_state, save_pretrained
from stemlm.checkpoint.runs import resolve_checkpoint
from stemlm.checkpoint.safe_write import verify_folder
from stemlm.checkpoint.sharded import is_sharded
from stemlm.cli.main import main
from stemlm.data import load_tokenizer
from stemlm.model import build_model
from stemlm.train.logging import read_metrics

from .conftest import fork_ranks, model_config, train_config
from .test_train_dist import losses

FITS = {
    "ddp": dict(parallel="ddp", table_optim="adamw", grad_accum=2),
    "host": dict(parallel="ddp", tables="host", table_optim="lazy_adamw"),
    "fsdp-adagrad": dict(parallel="fsdp", table_optim="rowwise_adagrad", grad_accum=2),  # one value per row
}
INITS = {
    "ddp": dict(parallel="ddp"),
    "fsdp": dict(parallel="fsdp"),
    "host": dict(parallel="fsdp", tables="host"),
    # A model folder (seed 7): each rank reads only the rows it keeps.
    "init-from-fsdp": dict(parallel="fsdp", init_from="SOURCE"),
    "init-from-ddp": dict(parallel="ddp", tables="host", init_from="SOURCE"),
}


def _init_checks(trainer, rank: int, source) -> dict[str, bool]:
    """Each materialised piece of this rank against the same rows of the 1-process initial model (bitwise)."""
    from torch.distributed.tensor import DTensor

    if trainer.cfg.init_from:
        full = read_state(source)
        out = {"meta": trainer.model_source.meta == ("folder", source)}
    else:
        full = build_model(trainer.config, seed=trainer.cfg.seed).state_dict()
        out = {"meta": trainer.model_source.meta == "init"}
    for i in trainer.tables.layers:
        name = trainer.tables.model_names[i]
        out[name] = torch.equal(trainer.tables.shard(i).detach().cpu(), full[name][rank::2])
    for name, param in trainer.model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local().detach()
            rows = -(-param.shape[0] // 2)
            out[name] = torch.equal(local, full[name][rank * rows : rank * rows + local.shape[0]])
        else:
            out[name] = torch.equal(param.detach(), full[name])
    return out


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from stemlm.errors import StemlmError
    from stemlm.train.parallel.launch import destroy_distributed
    from stemlm.train.trainer import Trainer

    checks = {}
    source = root / "source"
    for name, overrides in INITS.items():
        overrides = {k: str(source) if v == "SOURCE" else v for k, v in overrides.items()}
        cfg = train_config(assets, root / "init" / name, **overrides)
        model = model_config("stem") if "init_from" not in overrides else None
        checks[f"init-{name}"] = _init_checks(Trainer(model, cfg, progress=False), rank, source)
    from stemlm.placement.row_sharded import ShardedTables

    def no_gather(*args, **kwargs):
        raise AssertionError("a table or tensor was gathered")

    saved_gathers = dist.all_gather, ShardedTables.gather_rows
    for name, overrides in FITS.items():
        # DDP never all-gathers a tensor itself: any gather here would come from a checkpoint.
        dist.all_gather, ShardedTables.gather_rows = no_gather, no_gather
        try:
            cfg = train_config(assets, root / name, **overrides)
            Trainer(model_config("stem"), cfg, progress=False).fit()
        finally:
            dist.all_gather, ShardedTables.gather_rows = saved_gathers
        if rank == 0:
            shutil.copytree(root / name, root / "resumed" / name)
        dist.barrier()
        ckpt = root / "resumed" / name / "checkpoints" / "step-000003"
        Trainer.resume(ckpt, progress=False).fit()
    # The step-6 save fails while its files are written: the run reports it, step 4 stays the newest checkpoint.
    original = dcp.HuggingFaceStorageWriter.write_data

    def failing(self, plan, planner):
        if "step-000006" in str(self.path):
            raise OSError(28, "No space left on device")
        return original(self, plan, planner)

    dcp.HuggingFaceStorageWriter.write_data = failing
    cfg = train_config(assets, root / "failed", save_every=2, eval_every=0, keep_optimizer_state="newest")
    try:
        Trainer(model_config("stem"), cfg, progress=False).fit()
        checks["failed"] = "no error"
    except StemlmError as exc:
        checks["failed"] = str(exc)
    finally:
        dcp.HuggingFaceStorageWriter.write_data = original
    torch.save(checks, root / f"checks{rank}.pt")
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_ckpt")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        tokenizer = load_tokenizer(dist_assets["tokenizer"])
        save_pretrained(build_model(model_config("stem"), seed=7), root / "source", tokenizer=tokenizer)
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("name", list(INITS))
def test_each_rank_initialises_only_its_part_to_the_one_process_values(runs, name):
    for rank in range(2):
        checks = torch.load(runs / f"checks{rank}.pt")[f"init-{name}"]
        assert checks.pop("meta") is True
        assert checks and all(checks.values()), [k for k, v in checks.items() if not v]


@pytest.mark.dist
@pytest.mark.parametrize("name", list(FITS))
def test_sharded_checkpoint_resumes_bitwise(runs, name):
    run, resumed = runs / name, runs / "resumed" / name
    assert torch.equal(losses(resumed), losses(run))
    assert torch.equal(losses(resumed, "heldout_loss", "eval"), losses(run, "heldout_loss", "eval"))
    got, want = read_state(resumed / "checkpoints" / "step-000006"), read_state(run / "checkpoints" / "step-000006")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.dist
def test_checkpoint_holds_each_ranks_pieces_and_no_gathered_model(runs):
    ckpt = runs / "ddp" / "checkpoints" / "step-000006"
    assert is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    names = sorted(p.name for p in (ckpt / "dcp").iterdir())
    assert names == [f"shard-0000{r}-model-0000{f}-of-00002.safetensors" for r in (1, 2) for f in (1, 2)]
    assert verify_folder(ckpt)["ok"] and verify_folder(ckpt)["unrecorded"] == []
    # The replicated DDP backbone is split between the ranks' files; each table is in both (a row block each).
    keys = [set(safe_open(str(ckpt / "dcp" / names[2 * r]), "pt").keys()) for r in (0, 1)]
    tables = {k for k in keys[0] if "stem_embedding" in k}
    assert tables and tables == {k for k in keys[1] if "stem_embedding" in k}
    backbone = [k - tables for k in keys]
    assert all(backbone) and not backbone[0] & backbone[1]
    assert backbone[0] | backbone[1] == {f"model/{k}" for k in build_model(model_config("stem")).state_dict()} - tables
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["data"]["digest"].startswith("text:")
    assert not list((runs / "ddp" / "checkpoints").glob(".*"))  # no temporary folder left behind


@pytest.mark.dist
def test_a_failed_asynchronous_save_loses_nothing(runs):
    for rank in range(2):
        message = torch.load(runs / f"checks{rank}.pt")["failed"]
        assert message.startswith("writing a checkpoint failed: rank 0: OSError: [Errno 28] No space left"), message
        assert "rank 1: OSError" in message and "\n" not in message
    checkpoints = runs / "failed" / "checkpoints"
    assert resolve_checkpoint(runs / "failed").name == "step-000004"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest.json", "step-000002", "step-000004"]
    # keep_optimizer_state=newest: the older checkpoint lost its optimizer files, and its manifest says so.
    assert not list((checkpoints / "step-000002" / "dcp").glob("*-00002-of-00002.safetensors"))
    assert len(list((checkpoints / "step-000004" / "dcp").glob("*-00002-of-00002.safetensors"))) == 2
    assert all(verify_folder(checkpoints / s)["ok"] for s in ("step-000002", "step-000004"))
    assert [r["step"] for r in read_metrics(runs / "failed" / "metrics.jsonl") if r["kind"] == "train"][-1] == 6


@pytest.mark.dist
def test_export_of_a_two_rank_checkpoint_loads_everywhere(runs, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(runs / "ddp"), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sharded"] is True and summary["source"].endswith("step-000006")
    exported, sharded = read_state(out), read_state(runs / "ddp" / "checkpoints" / "step-000006")
    assert set(exported) == set(sharded) and all(torch.equal(exported[k], sharded[k]) for k in sharded)
    assert main(["generate", str(out), "Spain", "--greedy", "--max-new-tokens", "3"]) == 0


def test_a_checkpoint_of_the_older_pickled_format_is_not_resumed(tmp_path, dist_assets, dist_cache):
    """Older --nproc checkpoints kept optimizer state in DCP's pickled format: refused, never unpickled."""
    from stemlm.errors import StemlmError
    from stemlm.train.trainer import Trainer

    cfg = train_config(dist_assets, tmp_path / "run", steps=2, eval_every=0, save_every=0)
    Trainer(model_config("stem"), cfg, progress=False).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["distributed"] = {"world_size": 2, "parallel": "ddp", "optimizer_state": "dcp"}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(b"\x80\x04not to be unpickled")
    with pytest.raises(StemlmError, match="older stemlm --nproc run .* start from its weights with --init-from"):
        Trainer.resume(ckpt, overrides={"steps": 3}, progress=False)
