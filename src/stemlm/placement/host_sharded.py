"""Row-sharded token tables whose shards live in host memory: `stemlm train --tables host --nproc N`.

`HostShardedTables` is `ShardedTables` (same strided row ownership, same lookup plan, same checkpoints) with
each rank's shards, and therefore the table optimizer's state, in host memory (pinned on CUDA) instead of on
the rank's device. The rows this rank serves are read from its host shard and moved to the device for the
row exchange (NCCL needs device tensors; with gloo the move is a no-op); the backward moves the gradient rows
this rank owns back to the host as a sparse gradient of the host shard.

Look-ahead, as the 1-process host tables (stemlm.placement.host), on one worker thread (FIFO):
1. gather: for a training window, the host plan (every rank's ids are known: stemlm.placement.row_plan) and the
   rows this rank will serve, index_select into pinned memory and copied to the device on a side CUDA stream,
   queued two micro-batches ahead (and the next step's first window behind the table update);
2. the trainer's thread issues the row exchange of window k+1 (async all_to_all: collectives stay on one
   thread, in the same order on every rank) before computing window k;
3. the row-sparse table optimizer steps on the worker (`AsyncTableOptimizer`, `wrap`), overlapped with the
   backbone optimizer; the next step's first gather is queued behind it, so it reads the updated rows.
Evaluation lookups and checkpoints wait for the queue (`sync`, `before_save`). On a CPU every operation is the one
`ShardedTables` performs, on the same values, so training is bitwise equal to it. As a training placement
(`host-sharded`) it is `row-sharded` with the table optimizer wrapped and a report of the host bytes (`summary`).
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_host_shards.py -q`.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import nn

from stemlm.placement.host import AsyncTableOptimizer, InHostMemory
from stemlm.placement.lookahead import LookaheadWorker
from stemlm.placement.row_sharded import PendingRows, RowPlan, ShardedTables


class HostShardedTables(InHostMemory, LookaheadWorker, ShardedTables):
    """This rank's table shards in host memory, exchanged through `device`, gathered ahead on a worker."""

    name = "host-sharded"

    def __init__(self, model: nn.Module, device: torch.device, group=None, reduce: str = "mean") -> None:
        super().__init__(model, group=group, reduce=reduce)
        self.device = self.compute_device = device
        self.cuda = device.type == "cuda"
        with torch.no_grad():
            for key in list(self.shards):
                shard = self.shards[key].detach()
                # A model built on the meta device (stemlm.train.parallel.meta_init) gets uninitialised host rows.
                host = torch.empty_like(shard, device="cpu") if shard.is_meta else shard.to("cpu", copy=True)
                self.shards[key] = nn.Parameter(host.pin_memory() if self.cuda else host)
        self.meta_shards = False  # allocated on the host here, never by meta_init.materialise
        self._start_worker("stemlm-host-shards")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, Future] = {}
        self.last_window = -1

    def host_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[int, int]:
        """(bytes of this rank's host shards, bytes of their optimizer state)."""
        self.sync()
        tables = sum(p.numel() * p.element_size() for p in self.shards.values())
        state = 0
        if optimizer is not None:
            inner = getattr(optimizer, "inner", optimizer)
            state = sum(
                t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t)
            )
        return tables, state

    # ----- the exchange with host shards -----
    def _serve(self, plan: RowPlan) -> torch.Tensor:
        self.sync()  # an evaluation lookup: no queued update may be writing the shards
        return self._read_rows(plan.local_rows)[0]

    def _read_rows(self, local_rows: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The rows to serve, on the device: (rows, CUDA event after the copy or None)."""
        local_rows = local_rows.to("cpu")
        parts = [self.shard(i).detach().index_select(0, local_rows) for i in self.layers]
        if not self.cuda:
            return torch.cat(parts, dim=1), None
        staging = torch.empty(
            (local_rows.numel(), sum(p.shape[1] for p in parts)), dtype=parts[0].dtype, pin_memory=True
        )
        torch.cat(parts, dim=1, out=staging)
        with torch.cuda.stream(self.stream):
            rows = staging.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return rows, event

    def _to_master(self, grads: torch.Tensor, dtype: torch.dtype, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        return grads.to("cpu", dtype), plan.local_rows.to("cpu")

    def _shard_device(self) -> torch.device:
        return torch.device("cpu")

    # ----- look-ahead -----
    def _gather(self, all_ids) -> tuple[RowPlan, torch.Tensor, object]:
        plan = self.plan_on_host(all_ids, torch.device("cpu"))  # positions go to the device on the trainer's thread
        rows, event = self._read_rows(plan.local_rows)
        return plan, rows, event

    def prefetch(self, window: int) -> None:
        """Queue `window`'s plan and row gather on the worker (behind any queued table update)."""
        if window not in self.pending:
            self.pending[window] = self._timed(self._gather, self.ids_for(window))

    def start_window(self, window: int, dtype: torch.dtype | None = None) -> PendingRows:
        self.prefetch(window)
        plan, rows, event = self._wait(self.pending.pop(window))
        self.last_window = window
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            rows.record_stream(current)
        plan.positions = plan.positions.to(self.device, non_blocking=True)
        return self._exchange(plan, rows, dtype)

    # ----- the training placement: row-sharded, with the update on the worker -----
    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer], cfg) -> list:
        # The next step's rows are gathered behind the queued update (AsyncTableOptimizer), not by a hook.
        return [*optimizers, self.wrap(self._table_optimizer(cfg))]

    def before_save(self) -> None:
        self.sync()  # the queued table update lands before the shards are read

    def summary(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, object]:
        tables, state = self.host_bytes(optimizers[-1])  # this rank's
        return {
            "tables": "host",
            "device_bytes_saved": tables + state,
            "host_table_bytes": tables,
            "host_optimizer_bytes": state,
            "host_overlap": self.overlap(),
        }

    # ----- the host-side optimizer (stemlm.placement.host.AsyncTableOptimizer drives these) -----
    def wrap(self, optimizer: torch.optim.Optimizer):
        """The table optimizer stepped on the worker, overlapped with the backbone's (row-sparse ones only)."""
        return AsyncTableOptimizer(self, optimizer)

    def clear_grads(self) -> None:
        """Nothing to clear here: the shards' gradients are cleared by the update job that consumed them."""

    def close(self) -> None:
        self.sync()
        self.pending.clear()
        self.worker.shutdown(wait=True)
