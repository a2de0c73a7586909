"""The world a trainer runs in: a world of one answers every collective with its own value, a torchrun rank
joins the job's process group and agrees, sums and broadcasts with the other ranks; `detect_world` picks by
the environment torchrun (or srun) sets. Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_world.py -q`.
"""

from __future__ import annotations

import os

import pytest
import torch

from stemlm.train.config import TrainConfig
from stemlm.train.world import DistributedWorld, LocalWorld, detect_world
from tests.train.parallel.conftest import free_port

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID")


def test_a_world_of_one_answers_every_collective_with_its_own_value():
    world = LocalWorld(torch.device("cpu"))
    assert (world.rank, world.size, world.is_main, world.distributed, world.mesh) == (0, 1, True, False, None)
    assert world.agree(True, False) == (True, False)
    values = torch.tensor([1.5, 2.0])
    assert world.all_reduce_(values) is values and values.tolist() == [1.5, 2.0]
    assert world.broadcast("runs/x") == "runs/x"
    world.barrier()
    world.close()


def test_detect_world_is_one_process_unless_launched_as_one_rank_of_several(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    world = detect_world(TrainConfig(device="cpu"))
    assert type(world) is LocalWorld and world.device == torch.device("cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun with one process: still a world of one, no process group
    assert type(detect_world(TrainConfig(device="cpu"))) is LocalWorld


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    world = detect_world(TrainConfig(device="cpu", dist_timeout=60))
    summed = world.all_reduce_(torch.tensor([float(rank + 1), 10.0]))
    peak = world.all_reduce_(torch.tensor([float(rank)]), op="max")
    result = {
        "kind": type(world).__name__,
        "rank": (world.rank, world.size, world.is_main, world.distributed),
        "mesh": tuple(world.mesh.shape),
        "agree": world.agree(rank == 1, False),  # a flag raised by any rank is every rank's decision
        "sum": summed.tolist(),
        "max": peak.tolist(),
        "broadcast": world.broadcast(f"chosen by rank {rank}"),
    }
    world.barrier()
    torch.save(result, f"{out}/rank{rank}.pt")
    world.close()


@pytest.mark.dist
def test_ranks_of_a_distributed_world_agree_sum_and_broadcast(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["kind"] == DistributedWorld.__name__
        assert got["rank"] == (rank, 2, rank == 0, True) and got["mesh"] == (2,)
        assert got["agree"] == (True, False)
        assert got["sum"] == [3.0, 20.0] and got["max"] == [1.0]
        assert got["broadcast"] == "chosen by rank 0"
