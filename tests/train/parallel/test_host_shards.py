"""`--tables host` on 2 gloo processes: host-memory table shards train bitwise like device shards, and resume.

One fork of 2 ranks runs three `Trainer` fits of the same 6-step STEM run (row-sparse table
optimizer, grad_accum 2): shards on the device, shards on the host, and a host run resumed from its step-3
checkpoint. Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_host_shards.py -q`.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from .conftest import fork_ranks, free_port, model_config, records, train_config
from .test_train_dist import _cli_worker

RUN = dict(table_optim="lazy_adamw", grad_accum=2)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from stemlm.placement.host_sharded import HostShardedTables
    from stemlm.train.parallel.launch import destroy_distributed
    from stemlm.train.trainer import Trainer

    out = {}
    for tables in ("device", "host"):
        trainer = Trainer(model_config("stem"), train_config(assets, root / tables, tables=tables, **RUN))
        result = trainer.fit()
        out[tables] = {k: v.detach().clone() for k, v in trainer.tables.shards.items()}
        out[f"{tables}_host_class"] = isinstance(trainer.tables, HostShardedTables)
        out[f"{tables}_saved"] = result.get("device_bytes_saved")
        out[f"{tables}_rows"] = trainer.tables.num_local_rows()
    if rank == 0:
        shutil.copytree(root / "host", root / "resumed")
    dist.barrier()
    resumed = Trainer.resume(root / "resumed" / "checkpoints" / "step-000003", progress=False)
    resumed.fit()
    out["resumed"] = {k: v.detach().clone() for k, v in resumed.tables.shards.items()}
    torch.save(out, root / f"rank{rank}.pt")
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("host_shards")
    fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
def test_host_shards_train_bitwise_like_device_shards_and_resume(runs):
    assert records(runs / "host") == records(runs / "device")  # exact floats
    assert [r for r in records(runs / "resumed") if r[0] == "train"][-1] == [
        r for r in records(runs / "host") if r[0] == "train"
    ][-1]
    for rank in range(2):
        out = torch.load(runs / f"rank{rank}.pt")
        assert out["host_host_class"] and not out["device_host_class"]
        for key, shard in out["device"].items():
            assert torch.equal(out["host"][key], shard)
            assert torch.equal(out["resumed"][key], shard)
        # This rank's shard (333 rows split 167 / 166, width 128, fp32) plus lazy_adamw's two moments and steps.
        rows = out["host_rows"]
        assert rows == (167, 166)[rank]
        assert out["host_saved"] == 3 * rows * 128 * 4 + rows * 8
        assert out["device_saved"] is None


@pytest.mark.dist
def test_cli_run_on_the_default_corpus_with_host_shards(dist_assets, dist_cache, tmp_path, capfd):
    # `stemlm train --nproc 2` as torchrun starts its workers: on the embedded corpus the report scores the
    # mixed-in facts, which needs the unsharded model back on rank 0 (it used to fail after training).
    argv = [
        *("train", "--tables", "host", "--table-optim", "rowwise_adagrad", "--steps", "2", "--grad-accum", "2"),
        *("--batch-size", "2", "--seq-len", "32", "--tokenizer", str(dist_assets["tokenizer"]), "--fit-vocab"),
        *("--set", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2"),
        *("model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=64"),
        *("--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--json", "--out", str(tmp_path / "run")),
    ]
    mp.start_processes(_cli_worker, args=(2, free_port(), argv), nprocs=2, start_method="fork")
    out = capfd.readouterr().out  # rank 0 prints the report (the forked ranks share this process's stdout)
    report = json.loads(out[out.index("{") :])
    assert report["steps"] == 2 and report["tables"] == "host"
    assert report["facts"]["train_templates"]["prompts"] > 0
