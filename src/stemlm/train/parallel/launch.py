"""torchrun helpers: join the process group torchrun describes, split a global batch, build the launch command.

`torchrun_command(nproc, args)` is the command `stemlm train --nproc N` re-executes itself with; in each
worker `init_distributed()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
picks NCCL with one GPU per local rank when CUDA is available and gloo otherwise, and returns a `DistInfo`.
`local_batch_size(global_batch, world_size)` keeps the global batch fixed as N changes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stemlm.errors import StemlmError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_env() -> None:
    """Under `srun` with one task per GPU (no torchrun), take rank and world size from SLURM's variables.

    The job script exports MASTER_ADDR (e.g. the first host of `scontrol show hostnames`) and MASTER_PORT;
    without them a multi-task job is an error rather than N independent single-process runs.
    """
    if launched_by_torchrun() or int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in os.environ:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise StemlmError(
            f"SLURM job with {os.environ['SLURM_NTASKS']} tasks but no {' / '.join(missing)}: export the address "
            "and a free port of the first node in the job script"
        )
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=os.environ["SLURM_NTASKS"],
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
    )


def init_distributed(backend: str | None = None, device: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group described by torchrun's environment; a plain process gets a world of one."""
    if not launched_by_torchrun():
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return DistInfo(0, 1, 0, dev, None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise StemlmError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                "launch at most one process per GPU or pass --device cpu"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        # device_id binds the process group to this rank's GPU (NCCL connects eagerly, no device guessing).
        bound = {"device_id": dev} if use_cuda else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **bound)
    return DistInfo(rank, world, local_rank, dev, backend)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Sequences per rank for a fixed global batch; the global batch must split evenly."""
    if global_batch % world_size:
        raise StemlmError(
            f"global batch size {global_batch} does not split over {world_size} processes: "
            f"choose a batch size divisible by {world_size} or another --nproc"
        )
    return global_batch // world_size


def check_launch_flags(nproc: int, nnodes: int, rdzv_endpoint: str | None, parallel: str | None) -> None:
    """Refuse the multi-process flags a launch would ignore or fail on late: --parallel or --rdzv-endpoint with
    one process in all, a multi-node run without a HOST:PORT rendezvous address (port 1-65535)."""
    if nproc < 1 or nnodes < 1:
        raise StemlmError(f"--nproc and --nnodes must be at least 1, got {nproc} and {nnodes}")
    if parallel is not None and nproc * nnodes == 1:
        raise StemlmError(f"--parallel {parallel} needs --nproc N > 1 (one process trains the whole model)")
    if rdzv_endpoint is not None and nnodes == 1:
        raise StemlmError("--rdzv-endpoint is for --nnodes > 1 (one node meets on itself, --standalone)")
    if nnodes > 1:
        if not rdzv_endpoint:
            raise StemlmError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (a node every node can reach)")
        host, _, port = rdzv_endpoint.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 literal: [::1]:29500
        valid_host = bool(host) and not any(c.isspace() or c in "/@?#" for c in host)
        if not (valid_host and port.isdigit() and 0 < int(port) < 65536):
            raise StemlmError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT (e.g. node0:29500)")


def torchrun_command(
    nproc: int, args: list[str], module: str = "stemlm.cli.main", nnodes: int = 1, rdzv_endpoint: str | None = None
) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m <module> <args>` for this interpreter;
    with `nnodes` > 1 the same command runs on every node and they meet at `rdzv_endpoint` (c10d rendezvous)."""
    if nproc < 1 or nnodes < 1:
        raise StemlmError(f"--nproc and --nnodes must be at least 1, got {nproc} and {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise StemlmError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (a node every node can reach)")
    where = ["--standalone"]
    if nnodes > 1:
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=stemlm"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]
