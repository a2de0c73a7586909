"""Row-sharded token tables whose shards live in host memory: `stemlm train --tables host --nproc N`.

`HostShardedTables` is `ShardedTables` (same strided row ownership, same lookup plan, same checkpoints) with
each rank's shards, and therefore the table optimizer's state, in host memory (pinned on CUDA) instead of on
the rank's device. A lookup reads the rows this rank serves from its host shard, moves them to the device for
the row exchange (NCCL needs device tensors; with gloo the move is a no-op), and the backward moves the
gradient rows this rank owns back to the host as a sparse gradient of the host shard; the row-sparse table
optimizer then steps on the host. The exchange is collective, so here the rows are fetched when the forward
asks for them (no look-ahead thread; see stemlm.train.host_tables for the 1-process prefetching path).
On a CPU every operation is the one `ShardedTables` performs, so training is bitwise equal to it.
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/dist/test_host_shards.py -q`.
"""

from __future__ import annotations

import torch
from torch import nn

from stemlm.dist.comm import all_to_all_rows
from stemlm.dist.sharded_tables import RowPlan, ShardedTables, TableRowsFromShards


class HostShardedTables(ShardedTables):
    """This rank's table shards in host memory, exchanged through `device`."""

    def __init__(self, model: nn.Module, device: torch.device, group=None, reduce: str = "mean") -> None:
        super().__init__(model, group=group, reduce=reduce)
        self.device = device
        with torch.no_grad():
            for key in list(self.shards):
                host = self.shards[key].detach().to("cpu", copy=True)
                self.shards[key] = nn.Parameter(host.pin_memory() if device.type == "cuda" else host)

    def lookup(self, input_ids: torch.Tensor) -> TableRowsFromShards:
        plan = self.plan(input_ids)
        rows = _FetchHostRows.apply(self, plan, *(self.shard(i) for i in self.layers))
        return TableRowsFromShards(dict(zip(self.layers, rows, strict=True)), plan)

    def host_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[int, int]:
        """(bytes of this rank's host shards, bytes of their optimizer state)."""
        tables = sum(p.numel() * p.element_size() for p in self.shards.values())
        state = 0
        if optimizer is not None:
            state = sum(
                t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
            )
        return tables, state


class _FetchHostRows(torch.autograd.Function):
    """`ShardedTables`' row exchange with host shards: rows host -> device, gradients device -> host."""

    @staticmethod
    def forward(ctx, tables: HostShardedTables, plan: RowPlan, *shards: torch.Tensor):
        ctx.tables, ctx.plan = tables, plan
        ctx.shapes = [s.shape for s in shards]
        ctx.widths = [s.shape[1] for s in shards]
        ctx.master_dtype = shards[0].dtype
        local_rows = plan.local_rows.to("cpu")
        served = torch.cat([s.index_select(0, local_rows) for s in shards], dim=1)
        served = served.to(plan.positions.device, non_blocking=served.is_pinned())
        device_type = served.device.type
        if torch.is_autocast_enabled(device_type):  # as ShardedTables: rows cross in the autocast dtype
            served = served.to(torch.get_autocast_dtype(device_type))
        got = all_to_all_rows(served, plan.recv_counts, plan.send_counts, tables.group, tables.comm, "rows")
        if len(shards) == 1:
            return (got,)
        return tuple(part.contiguous() for part in got.split(ctx.widths, dim=1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        tables, plan = ctx.tables, ctx.plan
        grad = torch.cat(grads, dim=1)
        if tables.reduce == "mean" and tables.world_size > 1:
            grad = grad / tables.world_size
        back = all_to_all_rows(grad, plan.send_counts, plan.recv_counts, tables.group, tables.comm, "grads")
        back, indices = back.to("cpu", ctx.master_dtype), plan.local_rows.to("cpu")[None]
        shard_grads = [
            torch.sparse_coo_tensor(indices, part.contiguous(), shape, check_invariants=False)
            for part, shape in zip(back.split(ctx.widths, dim=1), ctx.shapes, strict=True)
        ]
        return (None, None, *shard_grads)
