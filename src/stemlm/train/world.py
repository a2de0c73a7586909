"""The processes a run trains on: a `World` (this process's rank, the world size, its device and the collectives
every rank takes part in), detected once by `detect_world(cfg)`.

    world = detect_world(cfg)          # one process: LocalWorld; a torchrun / srun rank: DistributedWorld
    Trainer(model_config, cfg, world=world).fit()

`LocalWorld` is a world of one: its collectives return their input and it has no process group or device mesh.
`DistributedWorld` joins the process group torchrun describes (`stemlm.train.parallel.launch.init_distributed`:
NCCL with one GPU per local rank, gloo on CPUs) and builds a 1-D device mesh over the ranks (FSDP2's and the
sharded checkpoints' mesh). The trainer asks the world only what differs between one process and many: who
writes the run folder (`is_main`), the decisions every rank must share (`agree`), sums over the ranks
(`all_reduce_`), a value rank 0 picks (`broadcast`), and `barrier`. Tests: tests/train/test_world.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stemlm.runtime import resolve_device
from stemlm.train.config import TrainConfig


@dataclass(frozen=True)
class LocalWorld:
    """One process: rank 0 of 1, no process group."""

    device: torch.device
    rank: int = 0
    size: int = 1
    backend: str | None = None
    distributed = False
    mesh = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """The decisions every rank takes: here this process's own."""
        return flags

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced (`op`: sum or max) over the ranks, in place: one rank's is itself."""
        return tensor

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        return value

    def barrier(self) -> None:
        """Wait for every rank: nothing to wait for."""

    def close(self) -> None:
        """Leave the world: nothing to leave."""


@dataclass(frozen=True)
class DistributedWorld(LocalWorld):
    """One rank of a torchrun (or srun) job; the process group is joined by `join`."""

    mesh: Any = field(default=None, compare=False)
    distributed = True

    @classmethod
    def join(cls, cfg: TrainConfig) -> DistributedWorld:
        from torch.distributed.device_mesh import init_device_mesh

        from stemlm.train.parallel.launch import init_distributed

        info = init_distributed(device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.dist_timeout)
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        return cls(info.device, info.rank, info.world_size, info.backend, mesh)

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        # One tiny all-reduce: a signal seen by any rank (or its save clock) stops / saves them all.
        votes = torch.tensor([float(f) for f in flags], device=self.device)
        self.all_reduce_(votes, op="max")
        return tuple(bool(v) for v in votes.tolist())

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        from stemlm.train.parallel.launch import destroy_distributed

        destroy_distributed()


def detect_world(cfg: TrainConfig) -> LocalWorld:
    """This process's world: a rank of the job torchrun (or SLURM's srun) started, else a world of one."""
    from stemlm.train.parallel.workers import distributed_worker

    if distributed_worker():
        return DistributedWorld.join(cfg)
    return LocalWorld(resolve_device(cfg.device))
